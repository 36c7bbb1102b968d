"""Multi-host engines on JAX's own runtime: start-up and the per-step hand-off.

Every host runs the same compiled steps over one global mesh (``jax.distributed``: after
:func:`initialize`, ``jax.devices()`` lists every host's devices and a jitted step is one
SPMD program across them).  Host 0 alone schedules and serves; each step it publishes the
``SchedulerOutput`` it is about to run, and the other hosts feed the same object to their
own model runner, so all runners build identical inputs and call the same executable in
the same order.  The hand-off uses the key-value store of JAX's coordination service (the
one ``jax.distributed.initialize`` starts on host 0): no separate RPC layer.
"""

from __future__ import annotations

import atexit
import logging
import pickle

import jax

from jaxllm.config import ParallelConfig

log = logging.getLogger("jaxllm.parallel")

_STOP = "__jaxllm_stop__"
_POLL_MS = 60_000


def initialize(pc: ParallelConfig) -> None:
    """Joins this process to the cluster (once; before anything touches a device).

    Unset coordinator / host index are left to JAX, which reads its environment
    (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) or a cluster
    manager (SLURM, ...)."""
    if not pc.multi_host or jax.distributed.is_initialized():
        return
    jax.distributed.initialize(coordinator_address=pc.distributed_coordinator, num_processes=pc.num_hosts,
                               process_id=pc.host_index)
    if jax.process_count() != pc.num_hosts:
        raise ValueError(f"--num-hosts {pc.num_hosts}, but the JAX cluster has {jax.process_count()} processes")
    log.info("host %d of %d: %d local and %d global devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())


def _client():
    from jax._src import distributed   # the client jax.distributed.initialize created
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


class StepChannel:
    """Host 0 -> the other hosts: each step's SchedulerOutput, in order, exactly once."""

    def __init__(self):
        self.client = _client()
        self.host = jax.process_index()
        self.num_hosts = jax.process_count()
        self.n = 0
        self.closed = False
        if self.is_leader:
            atexit.register(self.close)

    @property
    def is_leader(self) -> bool:
        return self.host == 0

    def _key(self, host: int, n: int) -> str:
        return f"jaxllm/step/{host}/{n}"

    def publish(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        for host in range(1, self.num_hosts):
            self.client.key_value_set_bytes(self._key(host, self.n), data)
        self.n += 1

    def receive(self):
        """The next published object (waits as long as host 0 is alive)."""
        key = self._key(self.host, self.n)
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, _POLL_MS)
                break
            except Exception as e:  # the client raises XlaRuntimeError for both cases
                if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                    continue    # an idle server: keep waiting
                raise
        self.client.key_value_delete(key)
        self.n += 1
        return pickle.loads(data)

    def close(self) -> None:
        """Tells the other hosts to stop following (host 0; idempotent)."""
        if self.is_leader and not self.closed:
            self.closed = True
            try:
                self.publish(_STOP)
            except Exception:  # the coordination service may already be gone at exit
                log.debug("could not publish the stop marker", exc_info=True)


def is_stop(obj) -> bool:
    return isinstance(obj, str) and obj == _STOP

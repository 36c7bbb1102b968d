"""The device mesh of one engine replica.

One axis, ``tp``: tensor parallelism over attention heads and MLP width, vocabulary
parallelism for the embedding and LM head, and (with ``--enable-expert-parallel``) the
axis experts are spread over.  A replica of a data-parallel engine gets its own slice of
the devices; on several hosts the mesh spans every host's devices (``jax.devices()`` is
global after ``jax.distributed.initialize``).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

TP = "tp"


def cpu_device_hint(n: int) -> str:
    return (f"on CPU, simulate devices with XLA_FLAGS=--xla_force_host_platform_device_count={n} "
            f"(set before JAX starts; `jaxllm serve` sets it itself)")


def replica_devices(tensor_parallel_size: int, data_parallel_size: int = 1, replica: int = 0) -> list:
    """The devices of data-parallel replica ``replica``: tp consecutive devices of the global list."""
    devices = jax.devices()
    need = tensor_parallel_size * data_parallel_size
    if need > len(devices):
        hint = cpu_device_hint(need) if devices[0].platform == "cpu" else "use fewer"
        raise ValueError(f"--tensor-parallel-size {tensor_parallel_size} x --data-parallel-size "
                         f"{data_parallel_size} needs {need} devices, {len(devices)} found ({hint})")
    return devices[replica * tensor_parallel_size:(replica + 1) * tensor_parallel_size]


def make_mesh(devices) -> Mesh:
    """A 1-D ``tp`` mesh over ``devices`` (one device: no parallelism, same code path)."""
    return Mesh(np.asarray(devices, dtype=object), (TP,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def tp_size() -> int:
    """Size of the ``tp`` axis of the mesh being traced under (``jax.set_mesh``); 1 outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TP not in mesh.shape:
        return 1
    return mesh.shape[TP]


def place(host, sharding) -> jax.Array:
    """A host (numpy) array -> a global array laid out by ``sharding``; each process
    transfers only the shards its own devices hold (works across hosts)."""
    host = np.asarray(host)
    if jax.process_count() == 1:
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_tree(tree, sharding):
    """:func:`place` over a pytree of host arrays (one batched transfer on a single host)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda a: place(a, sharding), tree)


def to_host(tree):
    """Replicated device arrays (a pytree) -> numpy.  Across hosts each process reads its own
    copy (``jax.device_get`` refuses arrays that span other processes' devices).  On one host
    ``np.asarray`` of each: a quarter of ``jax.device_get``'s host time for a step's eight
    small outputs (it starts every copy again; the runner started them at dispatch)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)

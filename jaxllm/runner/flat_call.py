"""A compiled program called on flat lists of device arrays: the host's share of a step.

A decode step of the built-in model takes ~490 arrays (424 weight arrays, 60 KV layers, the
sampler state, the packed inputs) and returns ~70.  Calling the ``jax.stages.Compiled``
flattens its pytrees and checks each array's signature every time: about 1 ms of host CPU
per step on a 2-vCPU Zen 3, and on the CPU backend that time is taken from the cores the
step's own kernels run on (a batch-1 token took ~0.4-0.7 ms longer).  The runner hands a
step the same kinds of arrays every time, placed with the shardings the program was compiled
for, so :class:`FlatProgram` gives them to the executable as JAX itself does once its checks
have passed (``ExecuteReplicated``: ``execute_sharded``, then the output handlers), and the
weights are flattened once (:class:`Leaves`).  A host array (numpy) is placed first, as the
compiled object's call would.  Where JAX's internals are not as expected (another version,
effects, ``jax_debug_nans``, several processes) the compiled object's own call runs: the
same results at the old cost.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
try:   # private: JAX's array placement and its debug-nans switch (see the docstring's fallback)
    from jax._src import dispatch as jax_dispatch
    from jax._src.lib import xla_client as xc
except ImportError:   # pragma: no cover
    jax_dispatch = xc = None


class Leaves(NamedTuple):
    """A pytree of device arrays flattened once (the weights): its structure and leaves."""

    treedef: object
    leaves: list

    @classmethod
    def of(cls, tree) -> Leaves:
        leaves, treedef = jax.tree.flatten(tree)
        return cls(treedef, leaves)

    def tree(self):
        return jax.tree.unflatten(self.treedef, self.leaves)


class FlatProgram:
    """``compiled`` (a ``jax.stages.Compiled`` of positional arguments), called as it is
    (``program(*args)``, each argument a pytree or :class:`Leaves`) with its outputs' pytree;
    ``compiled`` stays reachable for what reads the program (its avals, its text)."""

    def __init__(self, compiled):
        self.compiled = compiled
        self._exe = self._handlers = self._kept = None
        try:
            call = compiled._executable.unsafe_call
            exe, handlers, kept = call.xla_executable, call.out_handler.handlers, call.kept_var_idx
            # Per argument, in the avals' order (None where jit dropped an unused argument).
            shardings = jax.tree.structure(compiled.in_avals[0]).flatten_up_to(compiled.input_shardings[0])
            plain = not (call.ordered_effects or call.has_unordered_effects or call.has_host_callbacks
                         or call.mut is not None)
        except (AttributeError, ValueError):   # (ValueError: the shardings' tree is not the avals')
            return
        avals = jax.tree.leaves(compiled.in_avals[0])
        # Across processes each host's arrays are placed by the runner itself (mesh.place).
        if not plain or jax.process_count() > 1 or xc is None or len(avals) != len(shardings):
            return
        self._exe, self._handlers = exe, handlers
        self._shardings, self._avals = shardings, avals
        self._devices: dict[int, list] = {}   # a host argument's index -> its devices (_place)
        # Arguments XLA dropped as unused (jit's keep_unused=False) are not handed over.
        self._kept = None if len(kept) == len(shardings) else sorted(kept)
        self._out_tree = compiled.out_tree

    @property
    def fast(self) -> bool:
        """Whether calls skip the compiled object's per-call checks (False: the fallback)."""
        return self._exe is not None and not jax_dispatch.needs_check_special()

    def __call__(self, *args):
        if not self.fast:
            return self.compiled(*(a.tree() if isinstance(a, Leaves) else a for a in args))
        flat = []
        for a in args:
            if isinstance(a, Leaves):   # device arrays (the weights): nothing to look at per step
                flat += a.leaves
                continue
            for x in jax.tree.leaves(a):
                flat.append(self._place(len(flat), x) if isinstance(x, np.ndarray) else x)
        if len(flat) != len(self._avals):
            raise ValueError(f"{len(flat)} arrays where the program takes {len(self._avals)}")
        if self._kept is not None:
            flat = [flat[i] for i in self._kept]
        outs = self._exe.execute_sharded(flat).consume_with_handlers(self._handlers)
        return jax.tree.unflatten(self._out_tree, outs)

    def _place(self, i: int, x: np.ndarray) -> jax.Array:
        """Host array ``x`` as argument ``i``: a copy on each of its sharding's devices (the
        runner's host arguments are replicated; any other sharding takes ``jax.device_put``)."""
        aval, sharding = self._avals[i], self._shardings[i]
        if sharding is None:   # an argument jit dropped: not handed over
            return x
        if x.shape != aval.shape or x.dtype != aval.dtype:
            raise ValueError(f"argument {i}: {x.dtype}{list(x.shape)} where the program takes "
                             f"{aval.dtype}{list(aval.shape)}")
        if not sharding.is_fully_replicated:
            return jax.device_put(x, sharding)
        devices = self._devices.get(i)
        if devices is None:
            devices = self._devices[i] = sorted(sharding.addressable_devices, key=lambda d: d.id)
        return xc.batched_device_put(aval, sharding, [x] * len(devices), devices, True, False,
                                     xc.HostBufferSemantics.IMMUTABLE_ONLY_DURING_CALL)

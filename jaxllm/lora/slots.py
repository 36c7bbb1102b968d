"""The device slot arrays of the adapters and their writer.

Per target projection ``A [max_loras, L, in, R]`` and ``B [max_loras, L, R, out]`` in the
``--lora-dtype``, the ``A`` of q/k/v and of gate/up side by side in one array each
(``{"A": {"q+k+v": [max_loras, L, in, 3R], ...}, "B": {"q": ..., ...}, "rank": [max_loras]}``,
lora/apply.py's ``shrink_groups``: one shrink dot for the group); ``R`` = max_lora_rank, an
adapter of smaller rank is zero-padded (the padding adds zero; ``rank`` says where it starts,
so that the native kernel, cpu/lora.cc, does not read it).  For that kernel ``A`` is held
transposed, ``[max_loras, L, n*R, in]`` (lora/apply.py ``transposes_a``), so that a part's
first ``rank`` rows are contiguous and the padding is never read.  An adapter is sent as float32 and rounded to
that dtype on the device by the writer; bfloat16 slots halve what a step reads of them (lora/apply.py widens each slice it
reads to float32, so the arithmetic is float32's).
One compiled program writes an adapter into a slot (the old arrays donated: updated in
place), compiled at warm-up with the slot a traced argument, so loading, swapping or
unloading an adapter never compiles afterwards.

Under tensor parallelism each slot array is laid out like the base weight it adapts
(parallel/sharding.py ``lora_specs``): ``A`` split like the base's input, ``B`` like its output,
so a column-parallel projection's delta comes out split as its output is and a row-parallel
one's partial sums are reduced where the base's are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxllm.lora.apply import shrink_groups
from jaxllm.lora.peft import LoRAWeights
from jaxllm.lora.targets import Target


def _write(weights: dict, slot: jax.Array, new: dict) -> dict:
    # weights: {"A": {key: [S, L, in, n*R]}, "B": {param: [S, L, R, out]}}; new: the same without S.
    # new is float32: rounded here to the slots' dtype (numpy has no bfloat16 to send it in)
    return jax.tree.map(lambda W, w: W.at[slot].set(w.astype(W.dtype)), weights, new)


def _without_slot_axis(sharding):
    """A slot array's sharding -> that of one slot (its spec without the first axis)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))
    return sharding


def _transposed(sharding):
    """An ``A`` sharding -> that of ``A`` with its last two axes swapped."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (4 - len(tuple(sharding.spec)))
        return NamedSharding(sharding.mesh, P(*spec[:2], spec[3], spec[2]))
    return sharding


class LoRASlotArrays:
    def __init__(self, targets: dict[str, Target], num_layers: int, max_loras: int, max_rank: int, sharding,
                 shardings: dict | None = None, dtype: str = "float32", transposed: bool = False):
        """``sharding``: the replicated sharding (the slot index; every array without
        ``shardings``); ``shardings``: param -> (A's, B's) sharding (tensor parallelism);
        ``dtype``: the slots' dtype (``--lora-dtype``, resolved); ``transposed``: ``A`` held as
        ``[max_loras, L, n*R, in]`` (lora/apply.py ``transposes_a``: the native kernel's layout)."""
        self.targets, self.L, self.R = targets, num_layers, max_rank
        self.sharding, self.transposed = sharding, transposed
        per_param = shardings or {n: (sharding, sharding) for n in targets}
        if transposed:
            per_param = {n: (_transposed(a), b) for n, (a, b) in per_param.items()}
        # A group's members share one A array: only where their A are laid out alike (they are:
        # q/k/v and gate/up are all column-parallel, A whole)
        self.groups = shrink_groups(targets, lambda g: all(per_param[n][0] == per_param[g[0]][0] for n in g))
        self.shardings = {"A": {k: per_param[g[0]][0] for k, g in self.groups.items()},
                          "B": {n: per_param[n][1] for n in targets}, "rank": sharding}
        self.dtype = jnp.dtype(dtype)
        def zeros(shape, sh):
            return jax.device_put(jnp.zeros((max_loras, num_layers) + shape, self.dtype), sh)

        def a_shape(g):
            shape = (targets[g[0]].in_size, len(g) * max_rank)
            return shape[::-1] if transposed else shape

        self.weights = {
            "A": {k: zeros(a_shape(g), self.shardings["A"][k]) for k, g in self.groups.items()},
            "B": {n: zeros((max_rank, t.out_size), self.shardings["B"][n]) for n, t in targets.items()},
            # [max_loras] int32: each slot's adapter's rank (0: empty), for cpu/lora.cc to read no padding
            "rank": jax.device_put(jnp.zeros((max_loras,), jnp.int32), sharding)}
        # One adapter's arrays (no slot axis) are sent laid out as a slot of them is.
        self._one = jax.tree.map(_without_slot_axis, self.shardings)
        self._writer = jax.jit(_write, donate_argnums=(0,), out_shardings=self.shardings)

    def group_of(self, name: str) -> str:
        """The key of ``weights["A"]`` that holds ``name``'s A."""
        return next(k for k, g in self.groups.items() if name in g)

    def _padded(self, w: LoRAWeights | None) -> dict:
        """The slot layout without the slot axis, numpy: the adapter's, zero-padded; zeros where it has none."""
        out = {}
        for n, t in self.targets.items():
            A = np.zeros((self.L, t.in_size, self.R), np.float32)
            B = np.zeros((self.L, self.R, t.out_size), np.float32)
            if w is not None and n in w.weights:
                a, b = w.weights[n]
                A[:, :, :w.rank] = a
                B[:, :w.rank, :] = b
            out[n] = (A, B)
        A = {k: np.concatenate([out[n][0] for n in g], axis=-1) for k, g in self.groups.items()}   # [L, in, n*R]
        if self.transposed:
            A = {k: np.ascontiguousarray(a.swapaxes(-1, -2)) for k, a in A.items()}                 # [L, n*R, in]
        return {"A": A,
                "B": {n: out[n][1] for n in self.targets}, "rank": np.int32(0 if w is None else w.rank)}

    def write(self, slot: int, w: LoRAWeights | None) -> None:
        """Puts adapter ``w`` (None: zeros) into ``slot``."""
        new = jax.device_put(self._padded(w), self._one)
        self.weights = self._writer(self.weights, jax.device_put(np.int32(slot), self.sharding), new)

    def compile(self) -> None:
        """Compiles the writer (warm-up): writes zeros into slot 0."""
        self.write(0, None)

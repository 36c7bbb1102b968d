"""The LoRA delta a layer adds to a projection's output, per token, inside the compiled step.

The step carries the distinct slots its tokens use (``LoRAStep.used``, from the host) and a
loop over just those reads each used slot's ``A [in, R]`` / ``B [R, out]`` of this layer, the
shrink ``x @ A`` masked to the tokens of that slot, then the expand: the step's cost follows
the adapters in the batch, not ``max_loras`` (a step with no adapter runs no iteration).  The
loop's trip count is an input, so a new mix of adapters never compiles.  Measured on the
built-in model (docs/BENCHMARKS.md "LoRA adapters"): the earlier one-hot einsum over every
slot read ~20 MB of float32 ``A``/``B`` per slot per step, 0.16x of base at ``max_loras=8``.

A step that can use at most one slot (a one-token bucket: batch-1 decode; or ``max_loras``
1) runs no loop: a ``cond`` on that slot reads its matrices or nothing.  In the built-in
model's one-token program that is 490 dynamic slices and 3 copies instead of the loops' 1120
and 632; it compiles in the same time (docs/BENCHMARKS.md "LoRA adapters": the cost is the 420
shrink/expand dots and their fusions, not the loops).

Without ``used`` (training, lora/train.py: the loop's dynamic trip count is not
reverse-differentiable) the one-hot einsum over every slot is kept
(``einsum(x, one_hot(slot), A)``, as tpu-inference and sglang-jax do).
A token with slot -1 (the base model, or bucket padding) matches no slot: no delta.
The delta is float32 (on the native CPU path the activations are float32 already), whatever
the slots' dtype (``--lora-dtype``): a slice of a bfloat16 slot is widened before its dot.

When the step runs the GPU path (``Kernels.attention`` or ``Kernels.matmul`` "pallas"), the
delta is the Pallas kernel of ``pallas/lora.py`` instead (per token, only its own slot's
matrices are read).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jaxllm.pallas.lora import lora_delta


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoRAStep:
    """The step's adapters: the slot arrays and each token's slot."""

    weights: dict
    """param -> (A [max_loras, L, in, R], B [max_loras, L, R, out]), scale folded into B; float32,
    or the 16-bit ``--lora-dtype`` (each slice read is widened to float32)."""
    slots: jax.Array
    """[T] int32, each token's slot (-1: none)."""
    used: jax.Array | None = None
    """[max_loras] int32: the distinct slots in ``slots``, then -1s; None: every slot (the
    differentiable one-hot einsum)."""
    kernel: str = field(default="einsum", metadata=dict(static=True))
    """"einsum" (the one-hot shrink and expand) or "pallas" (``pallas/lora.py``)."""


def kernel_for(kernels) -> str:
    """The delta's implementation for a step run with ``kernels`` (models/kernels.py)."""
    return "pallas" if "pallas" in (kernels.attention, kernels.matmul) else "einsum"


def delta(lora: LoRAStep | None, name: str, x: jax.Array, layer) -> jax.Array | None:
    """x [T, in] -> the delta [T, out] float32 of projection ``name`` at ``layer`` (an int, or a
    traced index under ``lax.scan``); None when no adapter can change it."""
    if lora is None or name not in lora.weights:
        return None
    A, B = lora.weights[name]
    if lora.kernel != "pallas" and lora.used is not None:
        if x.shape[0] == 1 or A.shape[0] == 1:
            # one token (batch-1 decode) or one slot: at most one slot is used, ``used[0]``
            return _one_slot_delta(x, A, B, layer, lora.slots, lora.used[0])
        return _used_slots_delta(x, A, B, layer, lora.slots, lora.used)
    A_l, B_l = A[:, layer], B[:, layer]                                  # [S, in, R], [S, R, out]
    if lora.kernel != "pallas":
        A_l, B_l = _f32(A_l), _f32(B_l)
    if lora.kernel == "pallas":
        return lora_delta(x, A_l, B_l, lora.slots)                       # [T, out]
    onehot = jax.nn.one_hot(lora.slots, A.shape[0], dtype=jnp.float32)   # [T, S]
    xa = jnp.einsum("ti,sir->tsr", x.astype(jnp.float32), A_l) * onehot[:, :, None]   # [T, S, R]
    return jnp.einsum("tsr,sro->to", xa, B_l)                            # [T, out]


def _f32(w: jax.Array) -> jax.Array:
    # a slot slice in the --lora-dtype, widened: the shrink and expand accumulate in float32
    return w.astype(jnp.float32)


def _used_slots_delta(x, A, B, layer, slots, used) -> jax.Array:
    """x [T, in]; A [S, L, in, R], B [S, L, R, out]; slots [T]; used [S] -> [T, out] float32,
    reading only the used slots' matrices of ``layer``."""
    T, (_, _, n_in, R), n_out = x.shape[0], A.shape, B.shape[-1]
    xf = x.astype(jnp.float32)
    layer = jnp.asarray(layer, jnp.int32)

    def one_slot(i, acc):
        s = used[i]
        a = _f32(jax.lax.dynamic_slice(A, (s, layer, 0, 0), (1, 1, n_in, R))[0, 0])    # [in, R]
        b = _f32(jax.lax.dynamic_slice(B, (s, layer, 0, 0), (1, 1, R, n_out))[0, 0])   # [R, out]
        xa = jnp.where((slots == s)[:, None], xf @ a, 0.0)                         # [T, R]
        return acc + xa @ b                                                        # [T, out]

    # A dynamic trip count: the loop runs once per used slot (none when the step has no adapter).
    count = jnp.sum(used >= 0)
    return jax.lax.fori_loop(0, count, one_slot, jnp.zeros((T, n_out), jnp.float32))


def _one_slot_delta(x, A, B, layer, slots, s) -> jax.Array:
    """x [T, in]; A [S, L, in, R], B [S, L, R, out]; slots [T]; s: the step's one used slot
    (-1: none) -> [T, out] float32.  A step that can use at most one slot (a one-token bucket,
    or ``max_loras`` 1) needs no loop: a ``cond`` reads that slot's matrices of ``layer`` or
    nothing (no copies of a loop's carried values: the module docstring)."""
    T, (_, _, n_in, R), n_out = x.shape[0], A.shape, B.shape[-1]
    layer = jnp.asarray(layer, jnp.int32)

    def read():
        a = _f32(jax.lax.dynamic_slice(A, (s, layer, 0, 0), (1, 1, n_in, R))[0, 0])    # [in, R]
        b = _f32(jax.lax.dynamic_slice(B, (s, layer, 0, 0), (1, 1, R, n_out))[0, 0])   # [R, out]
        xa = jnp.where((slots == s)[:, None], x.astype(jnp.float32) @ a, 0.0)      # [T, R]
        return xa @ b                                                              # [T, out]

    return jax.lax.cond(s >= 0, read, lambda: jnp.zeros((T, n_out), jnp.float32))


def add(y: jax.Array, lora: LoRAStep | None, name: str, x: jax.Array, layer) -> jax.Array:
    """``y`` (the projection of ``x``) plus its LoRA delta, in ``y``'s dtype."""
    d = delta(lora, name, x, layer)
    return y if d is None else (y.astype(jnp.float32) + d).astype(y.dtype)


def add_fused(y: jax.Array, lora: LoRAStep | None, names: tuple[str, ...], x: jax.Array, layer) -> jax.Array:
    """``y``: a fused projection (the parts' outputs concatenated in ``names``' order) plus each
    part's delta.  The slot arrays hold every target the model has (lora/targets.py), so a
    part no adapter changes adds zeros."""
    if lora is None:
        return y
    deltas = [delta(lora, n, x, layer) for n in names]                   # [T, out_i] each
    return (y.astype(jnp.float32) + jnp.concatenate(deltas, axis=-1)).astype(y.dtype)

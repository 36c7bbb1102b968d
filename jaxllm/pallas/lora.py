"""The LoRA delta as a Pallas kernel: per token, ``x[t] @ A[slot[t]] @ B[slot[t]]`` (bgmv).

vLLM's punica ``bgmv`` (and sglang-jax's LoRA kernels) in one call: each program takes one
token, reads its slot, and multiplies the token's activations by that slot's shrink ``A``
``[in, R]`` then expand ``B`` ``[R, out]``; a token whose slot is -1 (the base model, or
bucket padding) writes zeros.  Only the token's own adapter is read, where the one-hot
einsum of ``lora/apply.py`` computes every slot's shrink and masks all but one (cheaper on
this CPU for few slots; on a GPU the gather-free per-token read is the point).  Ranks below
the slot arrays' rank are padded with zeros, which add nothing.

``lora_delta_reference`` is the same map in plain ``jnp`` (a per-token gather), the oracle of
``tests/kernels/test_pallas_lora.py``.  On CPU the kernel runs with ``interpret=True``; it has
not been lowered on a GPU here (Triton wants power-of-two blocks of at least 16 rows and
columns for its dots, which a tiny test model's ranks do not have).

This module imports only jax and numpy: it knows nothing of adapters, layers or models.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def lora_delta_reference(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """x [T, in], a [S, in, R], b [S, R, out], slots [T] int32 (-1: none) -> delta [T, out] float32."""
    safe = jnp.maximum(slots, 0)                                          # [T]
    xa = jnp.einsum("ti,tir->tr", x.astype(jnp.float32), a[safe].astype(jnp.float32))   # [T, R]
    d = jnp.einsum("tr,tro->to", xa, b[safe].astype(jnp.float32))         # [T, out]
    return jnp.where((slots >= 0)[:, None], d, 0.0)


def _kernel(slots_ref, x_ref, a_ref, b_ref, o_ref):
    # One program per token t: slots_ref [T] (whole), x_ref [1, in] (row t), a_ref [S, in, R]
    # and b_ref [S, R, out] (whole: the slot is data, so no block index can select it),
    # o_ref [1, out] (row t).
    t = pl.program_id(0)
    slot = slots_ref[t]
    safe = jnp.maximum(slot, 0)
    a = a_ref[safe]                                                       # [in, R]
    b = b_ref[safe]                                                       # [R, out]
    xa = jnp.dot(x_ref[...].astype(jnp.float32), a.astype(jnp.float32),
                 preferred_element_type=jnp.float32)                      # [1, R]
    d = jnp.dot(xa, b.astype(jnp.float32), preferred_element_type=jnp.float32)   # [1, out]
    o_ref[...] = jnp.where(slot >= 0, d, 0.0).astype(o_ref.dtype)


def _call(x, a, b, slots, *, interpret: bool):
    T, n_in = x.shape
    n_out = b.shape[-1]
    whole = lambda shape: pl.BlockSpec(shape, lambda t: (0,) * len(shape))   # noqa: E731
    return pl.pallas_call(
        _kernel,
        grid=(T,),
        in_specs=[whole(slots.shape), pl.BlockSpec((1, n_in), lambda t: (t, 0)), whole(a.shape), whole(b.shape)],
        out_specs=pl.BlockSpec((1, n_out), lambda t: (t, 0)),
        out_shape=jax.ShapeDtypeStruct((T, n_out), jnp.float32),
        interpret=interpret,
    )(slots, x, a, b)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array, *,
               interpret: bool | None = None) -> jax.Array:
    """x [T, in], a [S, in, R], b [S, R, out] (one layer's slot arrays), slots [T] int32 (-1:
    no adapter) -> the delta [T, out] float32.  ``interpret`` None: interpret mode on CPU."""
    if x.ndim != 2 or a.ndim != 3 or b.ndim != 3:
        raise ValueError(f"lora_delta: x must be [T, in], a [S, in, R], b [S, R, out]; got x {x.shape}, "
                         f"a {a.shape}, b {b.shape}")
    if a.shape[1] != x.shape[1] or b.shape[1] != a.shape[2] or b.shape[0] != a.shape[0]:
        raise ValueError(f"lora_delta: shapes do not chain: x {x.shape}, a {a.shape}, b {b.shape}")
    if slots.shape != (x.shape[0],):
        raise ValueError(f"lora_delta: slots must be [T]={x.shape[0]}, got {slots.shape}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return _call(x, a, b, slots.astype(jnp.int32), interpret=interpret)


lora_delta_jit = jax.jit(lora_delta, static_argnames=("interpret",))
"""The jitted entry (``interpret`` static)."""

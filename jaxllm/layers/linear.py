"""Linear maps over weights stored as transformers stores them: ``[out, in]``.

The contraction is ``x @ w.T`` written as a dot_general on the last axes of both, which
XLA's CPU runtime runs without materialising a transpose, and with float32 accumulation
so a bf16 weight is never upcast as a whole (DESIGN.md, "bf16 on XLA CPU").  On CPU the
native kernel (``jaxllm/cpu``) replaces XLA's dot when available: same function, faster
for decode-sized batches and for bf16 weights.
"""

import jax
import jax.numpy as jnp

from jaxllm.layers.storage import PACKED_BF16


def matmul(x: jax.Array, w: jax.Array, backend: str = "xla") -> jax.Array:
    """x [T, in] @ w[out, in]^T -> float32 [T, out]; ``backend="native"`` uses jaxllm/cpu."""
    if backend == "native":
        from jaxllm.cpu import native
        return native.linear(x, w)
    if w.dtype == PACKED_BF16:
        w = jax.lax.bitcast_convert_type(w, jnp.bfloat16)
    return jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, backend: str = "xla") -> jax.Array:
    # x [T, in], w [out, in] -> [T, out]
    y = matmul(x, w, backend)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)

"""Linear maps over weights stored as transformers stores them: ``[out, in]``.

The contraction is ``x @ w.T`` written as a dot_general on the last axes of both, which
XLA's CPU runtime runs without materialising a transpose, and with float32 accumulation
so a bf16 weight is never upcast as a whole (DESIGN.md, "bf16 on XLA CPU").
"""

import jax
import jax.numpy as jnp


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    # x [T, in], w [out, in] -> [T, out]
    y = jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)

"""Storage dtypes: bfloat16 kept as its uint16 bit pattern on CPU.

XLA:CPU has no bf16 kernels for scatter, gather or dynamic-update-slice; it converts the
whole operand to float32 and back (for a bf16 KV cache: the entire cache, every layer,
every step; for the embedding: the whole table).  Integer arrays have none of that, and
a bitcast between bf16 and uint16 is free, so on CPU bf16 weights and caches are stored
as uint16 and turned into float32 only for the small slices that are computed on.
"""

import jax
import jax.numpy as jnp

PACKED_BF16 = jnp.dtype(jnp.uint16)


def load(x: jax.Array) -> jax.Array:
    """Stored values -> float32 (bf16 bits are reinterpreted first)."""
    if x.dtype == PACKED_BF16:
        x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return x.astype(jnp.float32)


def store(x: jax.Array, dtype) -> jax.Array:
    """float values -> the storage ``dtype`` (uint16 means bf16 bits)."""
    if jnp.dtype(dtype) == PACKED_BF16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(dtype)

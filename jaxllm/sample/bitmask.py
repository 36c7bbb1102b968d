"""The grammar's allowed-token bitmask applied to a step's logits on the device.

``allowed`` is ``[S, ceil(V / 32)]`` uint32: bit ``v % 32`` of word ``v // 32`` set when token
``v`` may be drawn (llguidance's layout, filled on the host by ``structured/matchers.py``).
Rows without a grammar are all ones, so one executable serves constrained and free rows;
when no row is constrained the whole expansion is skipped by a ``lax.cond``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mask_words(vocab_size: int) -> int:
    """Words of one bitmask row for a vocabulary of ``vocab_size``."""
    return (vocab_size + 31) // 32


def apply_bitmask(x: jax.Array, allowed: jax.Array) -> jax.Array:
    """x [S, V] float32 -> x with the tokens ``allowed`` leaves out set to -inf."""
    S, V = x.shape

    def masked():
        shifts = jnp.arange(32, dtype=jnp.uint32)                          # [32]
        bits = (allowed[:, :, None] >> shifts[None, None, :]) & jnp.uint32(1)  # [S, W, 32]
        keep = bits.reshape(S, -1)[:, :V] != 0                               # [S, V]
        return jnp.where(keep, x, -jnp.inf)

    return jax.lax.cond(jnp.any(allowed != jnp.uint32(0xFFFFFFFF)), masked, lambda: x)

"""Counter-based noise for the Gumbel-argmax draw.

Each element's noise is a pure function of (request seed, output position, vocabulary
index): no state, no dependence on the batch row, the bucket or the order in which a
reduction visits the vocabulary.  The integer hash is written twice, for jnp and for
numpy, with the same uint32 operations, so a host reference can recompute any element.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

_GOLDEN = 0x9E3779B9
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32 multipliers (Wellons' hash prospector)


def _mix(x, xp):
    x = x ^ (x >> xp.uint32(16))
    x = x * xp.uint32(_C1)
    x = x ^ (x >> xp.uint32(15))
    x = x * xp.uint32(_C2)
    return x ^ (x >> xp.uint32(16))


def row_keys(seed_lo, seed_hi, position, xp=jnp):
    """[S] uint32 keys, one per (seed, output position)."""
    k = _mix(seed_lo.astype(xp.uint32) ^ _mix(seed_hi.astype(xp.uint32) ^ xp.uint32(_GOLDEN), xp), xp)
    return _mix(k ^ _mix(position.astype(xp.uint32) + xp.uint32(0x85EBCA6B), xp), xp)


def element_bits(keys, index, xp=jnp):
    """keys [S], index [V] -> [S, V] uint32 noise bits."""
    x = keys[:, None] ^ (index.astype(xp.uint32)[None, :] * xp.uint32(_GOLDEN))
    return _mix(_mix(x, xp) + keys[:, None], xp)


def uniform_from_bits(bits, xp=jnp):
    """uint32 -> float32 uniform in the open interval (0, 1), exactly representable."""
    return (bits >> xp.uint32(8)).astype(xp.float32) * xp.float32(2.0 ** -24) + xp.float32(2.0 ** -25)


def gumbel_noise(seed_lo, seed_hi, position, vocab_size: int) -> jnp.ndarray:
    """[S, V] float32 standard Gumbel noise."""
    keys = row_keys(seed_lo, seed_hi, position)
    u = uniform_from_bits(element_bits(keys, jnp.arange(vocab_size, dtype=jnp.uint32)))
    return -jnp.log(-jnp.log(u))


def split_seed(seed: int) -> tuple[int, int]:
    """A 64-bit seed as (low, high) uint32 words."""
    seed &= (1 << 64) - 1
    return seed & 0xFFFFFFFF, seed >> 32


def gumbel_noise_np(seed: int, position: int, vocab_size: int) -> np.ndarray:
    """Host version of one row of :func:`gumbel_noise`."""
    lo, hi = split_seed(seed)
    with np.errstate(over="ignore"):
        keys = row_keys(np.array([lo], np.uint32), np.array([hi], np.uint32), np.array([position]), xp=np)
        bits = element_bits(keys, np.arange(vocab_size, dtype=np.uint32), xp=np)[0]
    u = uniform_from_bits(bits, xp=np)
    return -np.log(-np.log(u))

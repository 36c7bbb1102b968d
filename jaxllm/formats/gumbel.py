"""Counter-based Gumbel noise for the draw, identical on the device (jnp) and the host (numpy).

Each element's noise is a pure function of (request seed, output position, vocabulary
index): an integer hash gives 32 random bits, their top 24 bits ``k`` pick the uniform
``u = (k + 1/2) / 2^24`` and the noise is ``g = -log(-log(u))``, computed with the exactly
rounded logarithm of ``numerics.py``.  No state, no dependence on the batch row, the bucket
or the order in which a reduction visits the vocabulary.  Because ``g`` depends on 24 bits
only, ``tests/sample/test_noise.py`` checks all 2^24 inputs: device noise equals host noise
bit for bit.  (The previous ``k * 2^-24 + 2^-25`` rounded the top ``k`` to ``u = 1.0``:
``g = +inf``, and ``-inf + inf = NaN`` then won the argmax on a masked-out token.)

The float64 variant (opt-in, the analog of vLLM's fp64 Gumbel) builds a 53-bit ``k`` from
two hashes and runs the same algorithm in float64; the trace must run under
``jax.enable_x64(True)`` (the sampler does that around the draw only).

:func:`noise_upper_bound` is a cheap bound ``g <= ub(bits)`` from the exponent of ``1 - u``
(no logarithm): the draw evaluates the exact noise only in the few vocabulary blocks whose
bound can still beat the best exact score (see ``draw.gumbel_argmax``).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxllm.formats.numerics import F32, F64, as_zero, bitcast, log_positive, neg_log_uniform

_GOLDEN = 0x9E3779B9
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32 multipliers (Wellons' hash prospector)
_SECOND = 0x632BE5AB                # salt of the second word (float64 noise)

G_MIN_F32 = -2.8523629              # noise of k = 0 (the smallest float32 noise value)


# ---------------------------------------------------------------- integer hash (uint32 everywhere)

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
    """keys [S], index [V] (shared) or [S, N] (per row) -> [S, V] / [S, N] uint32 noise bits."""
    idx = index.astype(xp.uint32)
    if idx.ndim == 1:
        idx = idx[None, :]
    x = keys[:, None] ^ (idx * xp.uint32(_GOLDEN))
    return _mix(_mix(x, xp) + keys[:, None], xp)


def second_bits(bits, keys, xp=jnp):
    """A second, independent uint32 per element (the float64 noise needs 53 bits)."""
    return _mix(bits ^ (keys[:, None] + xp.uint32(_SECOND)), xp)


def split_seed(seed: int) -> tuple[int, int]:
    """A 64-bit seed as (low, high) uint32 words."""
    seed &= (1 << 64) - 1
    return seed & 0xFFFFFFFF, seed >> 32


def runtime_zero(position):
    """[S, 1] int32 zeros the compiler cannot prove zero (``position >> 31`` of non-negative
    positions), for ``numerics.barrier``."""
    return (position.astype(jnp.int32) >> 31)[:, None]


# ---------------------------------------------------------------- bits -> noise

def gumbel_from_bits(bits, xp=jnp, zero=None, bits2=None):
    """uint32 noise bits -> standard Gumbel noise: float32, or float64 when ``bits2`` is given."""
    if bits2 is None:
        k = (bits >> xp.uint32(8)).astype(xp.int32)                  # 24 bits
        return -log_positive(neg_log_uniform(k, 24, F32, xp, zero), F32, xp, zero)
    hi = (bits >> xp.uint32(5)).astype(xp.int64)                     # 27 bits
    lo = (bits2 >> xp.uint32(6)).astype(xp.int64)                    # 26 bits
    k = (hi << xp.int64(26)) | lo                                    # 53 bits
    z = as_zero(zero, F64, xp)
    return -log_positive(neg_log_uniform(k, 53, F64, xp, z), F64, xp, z)


def gumbel_from_index(k, xp=jnp, zero=None):
    """Float32 noise of 24-bit indices ``k`` (the exhaustive test's entry point)."""
    return -log_positive(neg_log_uniform(k, 24, F32, xp, zero), F32, xp, zero)


_LN2_UP = float(np.nextafter(np.float32(math.log(2.0)), np.float32(1.0)))


def noise_upper_bound(bits, fp64: bool = False, xp=jnp):
    """A float32 upper bound of the noise of ``bits`` without a logarithm (within ln 2 of it).

    With w = 1 - u = j 2^-25, j = 2^25 - 2k - 1 (odd, >= 1): -log(u) >= w, so
    g = -log(-log u) <= -log w = 25 ln2 - log j <= (25 - floor(log2 j)) ln2.  floor(log2 j) is
    the float exponent of j (exact below 2^24; above, j can only round up to 2^25 at k = 0,
    where g < 0 <= the bound anyway).  The 1e-3 margin covers the rounding of the computed
    noise (a few 2^-24 relative) and of this product.  The float64 noise's 53-bit k has these
    24 bits on top, so the bound holds for it too, except at j = 1 where its finer grid
    reaches g = -log(2^-54) ~ 37.43."""
    k = (bits >> xp.uint32(8)).astype(xp.int32)
    j = (np.int32((1 << 25) - 1) - k - k).astype(np.float32)
    fl2 = (bitcast(j, np.int32, xp) >> np.int32(23)) - np.int32(127)
    ub = (np.int32(25) - fl2).astype(np.float32) * np.float32(_LN2_UP) + np.float32(1e-3)
    if fp64:
        ub = xp.where(fl2 == np.int32(0), np.float32(37.5), ub)
    return ub


# ---------------------------------------------------------------- the noise of a batch / a row

def gumbel_noise(seed_lo, seed_hi, position, vocab_size: int, fp64: bool = False) -> jnp.ndarray:
    """[S, V] standard Gumbel noise on the device (float64 needs x64 enabled by the caller)."""
    keys = row_keys(seed_lo, seed_hi, position)                      # [S]
    return noise_at(keys, jnp.arange(vocab_size, dtype=jnp.uint32), runtime_zero(position), fp64)


def noise_at(keys, index, zero, fp64: bool = False, xp=jnp):
    """Noise of rows ``keys`` [S] at vocabulary ``index`` ([V] shared or [S, N] per row)."""
    bits = element_bits(keys, index, xp)
    if not fp64:
        return gumbel_from_bits(bits, xp, zero)
    return gumbel_from_bits(bits, xp, zero, bits2=second_bits(bits, keys, xp))


def gumbel_noise_np(seed: int, position: int, vocab_size: int, fp64: bool = False) -> np.ndarray:
    """Host version of one row of :func:`gumbel_noise`: [V] float32 (or float64)."""
    lo, hi = split_seed(seed)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        keys = row_keys(np.array([lo], np.uint32), np.array([hi], np.uint32), np.array([position]), xp=np)
        return noise_at(keys, np.arange(vocab_size, dtype=np.uint32), None, fp64, xp=np)[0]

"""Exactly reproducible float kernels for the sampler, written once for jnp and numpy.

The parallel sampler must draw bit-identically to the serial host reference, so every
float that decides a token (the Gumbel noise, the top-p masses, the penalties) is computed
by the same sequence of exactly rounded IEEE operations on both sides:

* ``jnp.log``/``jnp.exp`` (XLA's polynomials) and ``np.log``/``np.exp`` (libm, SIMD) differ
  in the last bit, so ``log_positive``, ``neg_log_uniform`` and ``exp_nonpos`` below use only
  +, -, *, /, floor, int<->float conversions and bit manipulation.
* XLA:CPU contracts ``a * b + c`` into a fused multiply-add (measured: all of a 1M-element
  ``a*b+c`` equalled the fused result); numpy never fuses.  A product that feeds an addition
  therefore goes through :func:`barrier` unless it is exact (a power of two, or operands
  with few significant bits), where fused and unfused results agree anyway.
* Sums that decide a token (top-p masses) are taken over integers (fixed-point "limbs"),
  which no reduction order can change; only the final integer -> float conversion rounds.

Every function takes ``xp`` (``jnp`` or ``np``).  numpy callers pass no ``zero``; device
callers pass a runtime zero (``position >> 31`` of non-negative positions) that the compiler
cannot fold.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


class Format:
    """Constants of one float format (float32 or float64)."""

    def __init__(self, dtype, itype, utype, mant_bits: int, bias: int, n_coef_generic: int, n_coef_wide: int,
                 ln2_bits: int, n_exp_coef: int):
        self.dtype, self.itype, self.utype = dtype, itype, utype
        self.mant_bits, self.bias = mant_bits, bias
        self.mant_mask = (1 << mant_bits) - 1
        self.one_bits, self.half_bits = bias << mant_bits, (bias - 1) << mant_bits
        # Mantissa field of sqrt(2): above it the mantissa is halved, so m is in [sqrt(1/2), sqrt(2)).
        self.sqrt2_mant = int(math.floor((math.sqrt(2.0) - 1.0) * (1 << mant_bits)))
        # log1p(f) = 2 atanh(s), s = f / (2 + f) = 2s + s z P(z), z = s^2, P = sum_j 2/(2j+3) z^j.
        # |s| <= 0.1716 after the mantissa reduction ("generic") and <= 1/3 for the upper half of
        # the uniform ("wide"); the counts put the first omitted term below 2^-(p+2).
        self.coef_generic = [2.0 / (2 * j + 3) for j in range(n_coef_generic)]
        self.coef_wide = [2.0 / (2 * j + 3) for j in range(n_coef_wide)]
        # exp(r) = sum r^j / j!, |r| <= ln2 / 2.
        self.coef_exp = [1.0 / math.factorial(j) for j in range(n_exp_coef)]
        # ln 2 = HI + LO with few significant bits each, so n * HI and n * LO are exact for any
        # exponent n (|n| < 2^11) and a fused multiply-add cannot change them.
        ln2 = math.log(2.0)
        hi = math.floor(ln2 * 2.0 ** ln2_bits) / 2.0 ** ln2_bits
        lo_exp = math.floor(math.log2(ln2 - hi))
        lo = round((ln2 - hi) * 2.0 ** (ln2_bits - 1 - lo_exp)) / 2.0 ** (ln2_bits - 1 - lo_exp)
        self.ln2_hi, self.ln2_lo = hi, lo


F32 = Format(np.float32, np.int32, np.uint32, 23, 127, n_coef_generic=5, n_coef_wide=8, ln2_bits=16,
             n_exp_coef=9)
F64 = Format(np.float64, np.int64, np.uint64, 52, 1023, n_coef_generic=10, n_coef_wide=16, ln2_bits=40,
             n_exp_coef=16)


def bitcast(x, dtype, xp):
    if xp is np:
        return x.view(dtype)
    return jax.lax.bitcast_convert_type(x, dtype)


def const(v, fmt: Format, xp):
    """A constant of the format's float dtype (a numpy scalar keeps numpy arithmetic in float32)."""
    return fmt.dtype(v) if xp is np else xp.asarray(v, dtype=fmt.dtype)


def as_zero(zero, fmt: Format, xp):
    if zero is None:
        if xp is not np:
            raise ValueError("zero: device code needs a runtime zero (see numerics.barrier)")
        return fmt.itype(0)
    return zero.astype(fmt.itype) if hasattr(zero, "astype") else fmt.itype(zero)


def barrier(x, zero, fmt: Format = F32, xp=jnp):
    """x, rounded to its format and opaque to the compiler.

    ``zero`` is a runtime 0 OR'd into the bits: neither XLA nor LLVM can fold it, so a product
    passed through here is materialised (rounded) before the addition that follows it and
    is never fused into an FMA.  One integer op, far cheaper than the division that would
    otherwise stand in for the product."""
    return bitcast(bitcast(x, fmt.itype, xp) | as_zero(zero, fmt, xp), fmt.dtype, xp)


# ---------------------------------------------------------------- logarithm

def _decompose(x, fmt: Format, xp):
    """Positive normal x -> (e, f): x = 2^e (1 + f), 1 + f in [sqrt(1/2), sqrt(2)), f exact."""
    it = fmt.itype
    b = bitcast(x, it, xp)
    mant = b & it(fmt.mant_mask)
    e = (b >> it(fmt.mant_bits)) - it(fmt.bias)
    big = mant > it(fmt.sqrt2_mant)
    m = bitcast(xp.where(big, mant | it(fmt.half_bits), mant | it(fmt.one_bits)), fmt.dtype, xp)
    e = xp.where(big, e + it(1), e)
    return e, m - const(1.0, fmt, xp)            # Sterbenz: m - 1 is exact for m in [1/2, 2]


def _log_parts(e, f, coefs, fmt: Format, xp, zero):
    """log(2^e (1 + f)) with exactly rounded operations and no fusible multiply-add."""
    c = lambda v: const(v, fmt, xp)  # noqa: E731
    s = f / (c(2.0) + f)
    z = s * s
    p = c(coefs[-1])
    for coef in reversed(coefs[:-1]):
        p = c(coef) + barrier(z * p, zero, fmt, xp)
    lm = (s + s) + barrier((s * z) * p, zero, fmt, xp)     # log(1 + f) = 2s + s z P(z)
    ef = e.astype(fmt.dtype)
    return (lm + ef * c(fmt.ln2_lo)) + ef * c(fmt.ln2_hi)  # both products exact


def log_positive(x, fmt: Format = F32, xp=jnp, zero=None):
    """Natural log of positive normal floats (<= 2 ulp), bit-identical in jnp and numpy."""
    e, f = _decompose(x, fmt, xp)
    return _log_parts(e, f, fmt.coef_generic, fmt, xp, as_zero(zero, fmt, xp))


def neg_log_uniform(k, nbits: int, fmt: Format = F32, xp=jnp, zero=None):
    """-log(u) for u = (k + 1/2) / 2^nbits, k an integer array in [0, 2^nbits).

    u is never rounded: below 1/2 it is exact ((2k+1) 2^-(nbits+1) has nbits significant
    bits); above, u itself needs one bit more than the format has, so the log is taken as
    log1p of the exact f = u - 1 = -(2(2^nbits - k) - 1) 2^-(nbits+1)."""
    it = fmt.itype
    k = k.astype(it)
    lower = k < it(1 << (nbits - 1))
    scale = const(2.0 ** -(nbits + 1), fmt, xp)
    u_low = (k + k + it(1)).astype(fmt.dtype) * scale
    f_high = -(((it(1 << nbits) - k) * it(2) - it(1)).astype(fmt.dtype) * scale)
    e_low, f_low = _decompose(xp.where(lower, u_low, const(1.0, fmt, xp)), fmt, xp)
    e = xp.where(lower, e_low, it(0))
    f = xp.where(lower, f_low, f_high)
    return -_log_parts(e, f, fmt.coef_wide, fmt, xp, as_zero(zero, fmt, xp))


# ---------------------------------------------------------------- exponential of x <= 0

_INV_LN2 = 1.0 / math.log(2.0)


def exp_nonpos(x, xp=jnp, zero=None):
    """exp(x) for float32 x <= 0 (-inf allowed -> 0); results below 2^-125 are flushed to 0 so
    no subnormal (which XLA may flush and numpy keeps) is ever produced.  <= 2 ulp."""
    fmt = F32
    c = lambda v: const(v, fmt, xp)  # noqa: E731
    zero = as_zero(zero, fmt, xp)
    x = xp.maximum(x, c(-104.0))                               # -inf -> underflows to 0 below
    n = xp.floor(barrier(x * c(_INV_LN2), zero, fmt, xp) + c(0.5))
    r = (x - n * c(fmt.ln2_hi)) - n * c(fmt.ln2_lo)            # |r| <~ ln2/2; products exact
    coefs = fmt.coef_exp
    p = c(coefs[-1])
    for coef in reversed(coefs[:-1]):
        p = c(coef) + barrier(r * p, zero, fmt, xp)
    ni = n.astype(np.int32)
    scale = bitcast(xp.maximum(ni + np.int32(127), np.int32(0)) << np.int32(23), np.float32, xp)
    return xp.where(ni >= np.int32(-125), p * scale, c(0.0))   # times 2^n: exact


# ---------------------------------------------------------------- fixed-point masses for top-p

LIMB_BITS = 12
"""Masses e = exp(x - max) in [0, 1] are summed as three 12-bit integer limbs (resolution
2^-36 of the top token); each limb sum stays below 2^31 for vocabularies under 2^19."""


def limbs(e, xp=jnp):
    """e in [0, 1] float32 -> (hi, mid, lo) float32 integers in [0, 2^12] with
    e ~ hi 2^-12 + mid 2^-24 + lo 2^-36 (exact truncation: every step scales by a power of two
    or takes a fraction, all exact).  Kept as floats: sums of up to 16 of them are exact
    in float32, which is how the device sums them (see ``truncation.mass``)."""
    s = np.float32(2.0 ** LIMB_BITS)
    a = e * s
    hi = xp.floor(a)
    a = (a - hi) * s
    mid = xp.floor(a)
    lo = xp.floor((a - mid) * s)
    return hi, mid, lo


def combine(hi, mid, lo, xp=jnp):
    """Limb sums (uint32) -> float32 mass in units of the top token: a deterministic function of
    the exact integer sums, monotone in each of them."""
    f = np.float32
    return (hi.astype(f) + mid.astype(f) * f(2.0 ** -LIMB_BITS)) + lo.astype(f) * f(2.0 ** (-2 * LIMB_BITS))


# ---------------------------------------------------------------- monotone integer keys of floats

def float_key(x, xp=jnp):
    """float32 -> uint32 with the same order (x canonical: no -0.0, no NaN)."""
    b = bitcast(x, np.uint32, xp)
    neg = (b >> np.uint32(31)) == np.uint32(1)
    return xp.where(neg, ~b, b | np.uint32(0x80000000))

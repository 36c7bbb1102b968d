"""The quantized KV cache's pages (``--kv-cache-dtype``): their storage formats and the
quantize / dequantize rules every attention backend shares (the XLA path in
``layers/attention.py``, the Pallas kernel, the native CPU kernel).

``auto`` keeps the model dtype: the cache is a plain array per layer and K/V.  The others
make each cache array a :class:`QuantPages`: the 1-byte values and, for int8, one float16
scale per token per KV head stored beside them (same rank as the values, last axis 1, so
the cache's sharding spec and every index apply to both unchanged).

* ``int8``: symmetric, ``scale = max|x| / 127`` over head_dim, ``q = round(x / scale)``.
* ``fp8`` (= ``fp8_e4m3``, as vLLM) and ``fp8_e5m2``: the values cast to the format with
  scale 1.0, saturated at the format's largest finite value so that an outlier stays
  finite (e4m3fn has no infinity: an unclipped cast makes it NaN).  vLLM would take
  per-layer ``k_scale`` / ``v_scale`` from the checkpoint; we do not read them.

On CPU fp8 values are stored as their uint8 bit patterns: XLA:CPU has no fp8 scatter and
converted the whole cache to float16 and back on every write (measured in the compiled
HLO), the same reason bf16 is kept as uint16 (``formats/storage.py``).  int8 and float16
scatter in place.  Which format a flag value names, and the XLA path's scatter / gather,
are ``layers/kv_quant.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

FP8 = {"fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn), "fp8_e5m2": jnp.dtype(jnp.float8_e5m2)}
"""The fp8 formats' value dtypes, by format name."""
SCALE_DTYPE = jnp.dtype(jnp.float16)
"""int8 scales: 2 bytes per token per KV head (float32 would take the int8 cache from 1.94x
to 1.88x the tokens of bf16 at head_dim 64; float16's 11-bit mantissa is far finer than
int8's step)."""


@dataclass(frozen=True)
class KVFormat:
    """How a quantized cache is stored: ``name`` ("int8", "fp8_e4m3", "fp8_e5m2") and the
    arrays' dtypes (``scale_dtype`` None: no scales)."""

    name: str
    data_dtype: jnp.dtype
    scale_dtype: jnp.dtype | None


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantPages:
    """One quantized K or V cache: ``data`` ``[(L,) NB, BS, Hkv, Dh]`` and, for int8,
    ``scale`` ``[(L,) NB, BS, Hkv, 1]``.  ``format`` is static (part of the pytree's
    structure, so of every compiled program's signature)."""

    data: jax.Array
    scale: jax.Array | None
    format: str = field(default="int8", metadata=dict(static=True))

    @property
    def shape(self):
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim


def _values(data: jax.Array, fmt: str) -> jax.Array:
    """Stored bytes -> float32 (fp8 bit patterns reinterpreted first)."""
    if fmt in FP8 and data.dtype == jnp.uint8:
        data = jax.lax.bitcast_convert_type(data, FP8[fmt])
    return data.astype(jnp.float32)


def quantize(x: jax.Array, fmt: KVFormat | str, data_dtype=None) -> tuple[jax.Array, jax.Array | None]:
    """x ``[..., Dh]`` float -> (values ``[..., Dh]`` of ``data_dtype``, scale ``[..., 1]``
    float16 or None)."""
    name = fmt.name if isinstance(fmt, KVFormat) else fmt
    x = x.astype(jnp.float32)
    if name == "int8":
        amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)                     # [..., 1]
        # The scale is rounded to float16 first and the values divided by the rounded one,
        # so dequantizing with the stored scale is exact up to int8's own rounding.
        scale = jnp.minimum(amax / 127.0, jnp.finfo(SCALE_DTYPE).max).astype(SCALE_DTYPE)
        s = scale.astype(jnp.float32)
        q = jnp.where(s > 0, x / jnp.where(s > 0, s, 1.0), 0.0)
        return jnp.clip(jnp.round(q), -127, 127).astype(jnp.int8), scale
    f8 = FP8[name]
    big = float(jnp.finfo(f8).max)
    v = jnp.clip(x, -big, big).astype(f8)                                     # saturate, never inf/NaN
    if data_dtype is not None and jnp.dtype(data_dtype) == jnp.uint8:
        v = jax.lax.bitcast_convert_type(v, jnp.uint8)
    return v, None


def dequantize(pages: QuantPages) -> jax.Array:
    """The float32 values a (slice of a) quantized cache holds."""
    v = _values(pages.data, pages.format)
    return v if pages.scale is None else v * pages.scale.astype(jnp.float32)


def allocate(fmt: KVFormat, shape: tuple, make) -> QuantPages:
    """Zeroed pages of ``shape`` ``[(L,) NB, BS, Hkv, Dh]`` (``make``: jnp.zeros, or
    ShapeDtypeStruct for the shapes only)."""
    scale = None if fmt.scale_dtype is None else make((*shape[:-1], 1), fmt.scale_dtype)
    return QuantPages(make(shape, fmt.data_dtype), scale, fmt.name)

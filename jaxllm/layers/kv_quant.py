"""The quantized KV cache (``--kv-cache-dtype``) as the layers use it: which storage format a
flag value names, its bytes per token, and the XLA path's scatter / gather of a cache that
may be quantized.  The formats themselves (``QuantPages``, quantize / dequantize) are
``formats/kv_pages.py``'s, shared with the attention kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config import KV_CACHE_DTYPES
from jaxllm.formats import storage
from jaxllm.formats.kv_pages import FP8, SCALE_DTYPE, KVFormat, QuantPages, dequantize, quantize


def canonical(kv_cache_dtype: str) -> str:
    """The format a flag value names: "auto", "int8", "fp8_e4m3" or "fp8_e5m2"."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype


def kv_format(kv_cache_dtype: str, platform: str) -> KVFormat | None:
    """The storage of ``--kv-cache-dtype`` on ``platform``; None for "auto" (the model dtype)."""
    name = canonical(kv_cache_dtype)
    if name == "auto":
        return None
    if name == "int8":
        return KVFormat(name, jnp.dtype(jnp.int8), SCALE_DTYPE)
    return KVFormat(name, jnp.dtype(jnp.uint8) if platform == "cpu" else FP8[name], None)


def token_bytes(num_kv_heads: int, head_dim: int, itemsize: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes one token's K and V take in one layer: ``itemsize`` (the model dtype's) for
    "auto", else 1 per value plus the int8 scales."""
    name = canonical(kv_cache_dtype)
    if name == "auto":
        return 2 * num_kv_heads * head_dim * itemsize
    scale = SCALE_DTYPE.itemsize if name == "int8" else 0
    return 2 * num_kv_heads * (head_dim + scale)


def scatter(cache, index, x: jax.Array):
    """``cache`` with ``x`` (float ``[..., Hkv, Dh]``) stored at ``index``, in place
    (every index in bounds, see ``layers/attention.write_kv``)."""
    if not isinstance(cache, QuantPages):
        return cache.at[index].set(storage.store(x, cache.dtype), mode="promise_in_bounds")
    data, scale = quantize(x, cache.format, cache.data.dtype)
    data = cache.data.at[index].set(data, mode="promise_in_bounds")
    if scale is not None:
        scale = cache.scale.at[index].set(scale, mode="promise_in_bounds")
    return QuantPages(data, scale, cache.format)


def gather(cache, index) -> jax.Array:
    """float32 values of ``cache[index]`` (a model-dtype array or :class:`QuantPages`)."""
    if not isinstance(cache, QuantPages):
        return storage.load(cache[index])
    return dequantize(QuantPages(cache.data[index], None if cache.scale is None else cache.scale[index],
                                 cache.format))

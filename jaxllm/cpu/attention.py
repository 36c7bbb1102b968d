"""Paged attention through the native CPU kernel (``attention.cc``, built by ``native.py``).

:func:`paged_attention_native` computes :func:`jaxllm.layers.attention.paged_attention_xla`'s
function, with its signature, as one XLA custom call: each (token, KV head) walks only the
positions it may see through its block table, instead of XLA gathering whole KV chunks
per token.  It only reads the cache: the step's K/V are scattered by ``write_kv`` first.

A step with ``md.visible_upto`` (Gemma 3's image tokens, which see their whole image) calls
the ``*_vis`` targets, which take it as one more operand; a text-only step calls the causal
targets with the operands it always had, so its program does not change.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.cpu import native
from jaxllm.formats import storage
from jaxllm.formats.kv_pages import QuantPages

_TARGETS = {jnp.dtype(jnp.float32): "jaxllm_paged_attention_f32",
            storage.PACKED_BF16: "jaxllm_paged_attention_bf16"}
_QUANT_TARGETS = {"int8": "jaxllm_paged_attention_int8", "fp8_e4m3": "jaxllm_paged_attention_fp8_e4m3",
                  "fp8_e5m2": "jaxllm_paged_attention_fp8_e5m2"}


def paged_attention_native(q: jax.Array, kv, layer, md, *, scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks: jax.Array | None = None) -> jax.Array:
    """q [T, Hq, Dh] -> [T, Hq, Dh] (q's dtype), computed in float32; ``soft_cap`` and
    ``sinks`` [Hq] as in :func:`jaxllm.layers.attention.paged_attention_xla`.

    ``kv``: one layer's (K, V), each ``[NB, BS, Hkv, Dh]``, with ``layer`` None; or the
    stacked cache ``[L, NB, BS, Hkv, Dh]`` with ``layer`` the (possibly traced) index, which
    the kernel reads at that layer's offset: no slice of the cache is made.  The cache is
    float32 or bf16 (as bf16, or as its uint16 bits, see ``formats/storage.py``), or a
    quantized :class:`~jaxllm.formats.kv_pages.QuantPages` (int8 with its float16 scales, or
    fp8 as uint8 bits), dequantized by the kernel as it reads.

    ``md.visible_upto`` [T] (or None): query t sees keys up to max(positions[t],
    visible_upto[t]); the sliding window still counts back from positions[t].

    The engine picks this kernel only where it can run (``engine/resolve.py``: CPU, one
    device, a float32 or bf16 cache, the kernels built); the checks here guard the callers."""
    if not native.available():
        raise RuntimeError("paged_attention_native: the native CPU kernels are unavailable on this machine")
    k_cache, v_cache = kv
    scales = ()
    if isinstance(k_cache, QuantPages):
        target = _QUANT_TARGETS.get(k_cache.format)
        if target is None:
            raise ValueError(f"paged_attention_native: no kernel for a {k_cache.format} cache")
        if k_cache.scale is not None:
            scales = (k_cache.scale, v_cache.scale)
        k_cache, v_cache = k_cache.data, v_cache.data
        if k_cache.dtype != jnp.int8:
            # fp8 is taken as its bit pattern (the engine stores it so on CPU); the bitcast is free.
            k_cache, v_cache = (jax.lax.bitcast_convert_type(c, jnp.uint8) for c in (k_cache, v_cache))
    else:
        if k_cache.dtype == jnp.bfloat16:
            # The kernel takes bf16 as its bit pattern; the bitcast is free.
            k_cache, v_cache = (jax.lax.bitcast_convert_type(c, jnp.uint16) for c in (k_cache, v_cache))
        target = _TARGETS.get(jnp.dtype(k_cache.dtype))
        if target is None:
            raise ValueError(f"paged_attention_native: the cache must be float32 or bfloat16, not {k_cache.dtype}")
    want = 4 if layer is None else 5
    if k_cache.ndim != want:
        raise ValueError(f"paged_attention_native: a {'per-layer' if layer is None else 'stacked'} cache must be "
                         f"{want}-D, got {k_cache.shape}")
    layer_idx = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32).reshape(())
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"paged_attention_native: sinks must be [Hq] = [{q.shape[1]}], got {sinks.shape}")
    sinks = jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)   # [Hq] or [0]: none
    vis = ()
    if md.visible_upto is not None:
        target = target.replace("jaxllm_paged_attention_", "jaxllm_paged_attention_vis_")
        vis = (jnp.asarray(md.visible_upto, jnp.int32),)                                    # [T]
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k_cache, v_cache, *scales, md.block_tables.astype(jnp.int32),
        md.token_seq.astype(jnp.int32), md.positions.astype(jnp.int32), *vis, layer_idx, sinks,
        scale=np.float32(scale), sliding_window=np.int64(sliding_window or 0), soft_cap=np.float32(soft_cap or 0))
    return out.astype(q.dtype)

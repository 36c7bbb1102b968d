"""Paged attention over a ragged batch, and the metadata that describes that batch.

One step computes a flat token array mixing prefill chunks and decodes.  Each token
knows its sequence row and its position; its K/V are written into the paged cache first,
then the token attends over positions ``[0, position]`` (or the sliding window) of its own
sequence, read through that sequence's block table.  This one rule covers whole prompts,
prefill chunks that resume from cached KV, and single-token decodes.

``paged_attention_xla`` is the plain-XLA path, which runs everywhere and is the oracle
for the Pallas kernel (``jaxllm/pallas/ragged_paged_attention.py``) and the native CPU
kernel (``jaxllm/cpu/attention.cc``); :func:`attend` picks one of the three
(``--attention-backend``).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from jaxllm.cpu.attention import paged_attention_native
from jaxllm.layers import kv_quant
from jaxllm.pallas.ragged_paged_attention import default_kv_splits, ragged_paged_attention
from jaxllm.parallel.mesh import TP, tp_size
from jaxllm.parallel.sharding import kv_heads_axis

KVCache = tuple
"""(K, V), each a model-dtype array, or with ``--kv-cache-dtype`` int8/fp8 a
:class:`~jaxllm.formats.kv_pages.QuantPages` of the same shape (values, and int8's scales
beside them).  Stacked: each ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``
(layers under ``lax.scan``).  Unrolled: each a list of per-layer ``[num_blocks, block_size,
num_kv_heads, head_dim]`` arrays: with one stacked buffer, XLA:CPU copied the whole cache
whenever a layer read it between two in-place writes (measured: 42 ms -> 440 ms per
decode step as the pool grew), per-layer buffers have no such conflict."""


def _at(layer, *index):
    """Index into a stacked cache (``layer`` given) or a per-layer one (``layer`` None)."""
    return index if layer is None else (layer, *index)

_MASK_VALUE = -1e30  # finite, so a fully masked chunk cannot turn the running max into NaN


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    positions: jax.Array       # [T] int32, position of each token in its sequence
    slot_mapping: jax.Array    # [T] int32, flat cache slot (block * block_size + offset); padding -> null block 0
    token_seq: jax.Array       # [T] int32, row of each token's sequence
    block_tables: jax.Array    # [S, max_blocks] int32
    seq_lens: jax.Array        # [S] int32, KV length of each sequence after this step (0 for padding rows)
    query_start_loc: jax.Array  # [S + 1] int32, offsets of each sequence's tokens in the flat array
    # [T] int32 or None: the last position each query sees.  None: its own (causal).  Gemma 3's
    # image tokens see their whole image (bidirectional inside it; models/gemma3_vl/processing.py),
    # so the step holding an image must hold all of it.  Text-only steps pass None: unchanged.
    visible_upto: jax.Array | None = None


def write_kv(kv: KVCache, layer, slot_mapping: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
    """Scatters this step's K/V (``[T, Hkv, Dh]``) into the cache of ``layer``, in place.

    ``kv`` is one layer's (K, V) when ``layer`` is None, else the stacked cache.  A quantized
    cache is quantized here, on write (``layers/kv_quant.py``)."""
    k_cache, v_cache = kv
    BS = k_cache.shape[-3]
    # Every index is in bounds (padding tokens write to the null block), and saying so keeps
    # the update an in-place scatter: with mode="drop" XLA:CPU guarded it with a select over
    # the whole cache, and through a reshape to flat slots it rewrote the cache every layer.
    blk, off = slot_mapping // BS, slot_mapping % BS
    return kv_quant.scatter(k_cache, _at(layer, blk, off), k), kv_quant.scatter(v_cache, _at(layer, blk, off), v)


def kv_chunk_tokens(num_tokens: int, block_size: int) -> int:
    """KV positions visited per loop iteration: 128 for decode-sized batches (the last chunk
    of each row is gathered whole, so a longer chunk wastes more: at batch 32 and ~100-token
    contexts a 256-token chunk made a decode step 315 ms instead of 190 ms), smaller for big
    prefills so the gathered K/V of one iteration stays around 32 Ki token-positions."""
    chunk = 128
    while chunk > block_size and num_tokens * chunk > 32768:
        chunk //= 2
    return max(chunk, block_size)


def paged_attention_xla(q: jax.Array, kv: KVCache, layer, md: AttentionMetadata, *, scale: float,
                        sliding_window: int | None = None, soft_cap: float | None = None,
                        sinks: jax.Array | None = None) -> jax.Array:
    """Plain-XLA paged attention with an online softmax over KV chunks.

    q [T, Hq, Dh] -> [T, Hq, Dh].  Loops only as far as the longest sequence in the batch,
    so the cost follows the real context, not ``max_model_len``.  ``sliding_window`` W: a
    token sees its last W positions (itself included); ``soft_cap`` c: scores become
    ``c * tanh(s / c)`` before the softmax (Gemma 2); ``sinks`` [Hq]: one learned logit per
    query head that joins the softmax's denominator and contributes no value (GPT-OSS).
    """
    k_cache, v_cache = kv
    T, Hq, Dh = q.shape
    BS, Hkv = k_cache.shape[-3], k_cache.shape[-2]
    G = Hq // Hkv
    chunk = kv_chunk_tokens(T, BS)
    cb = chunk // BS                                        # blocks per chunk
    tables = md.block_tables[md.token_seq]                   # [T, MB]
    # At least two chunks of columns: with one, the chunk's gather is loop-invariant, XLA
    # hoists it out of the loop and fuses it with the cache write, which then stops being
    # in place (a copy of the layer's whole cache per step, measured).
    pad = max(2 * cb, -(-tables.shape[1] // cb) * cb) - tables.shape[1]
    if pad:
        tables = jnp.pad(tables, ((0, 0), (0, pad)))
    qg = (q.astype(jnp.float32) * scale).reshape(T, Hkv, G, Dh)
    # a query sees up to max(its position, visible_upto): never less than causal
    kv_len = (md.positions if md.visible_upto is None else jnp.maximum(md.positions, md.visible_upto)) + 1   # [T]
    # the window counts back from the query's own position, not from what it may see ahead
    lo = jnp.zeros_like(kv_len) if sliding_window is None else md.positions + 1 - sliding_window
    n_chunks = (jnp.max(kv_len) + chunk - 1) // chunk

    def body(j, carry):
        m, l, acc = carry                                    # [T,Hkv,G], [T,Hkv,G], [T,Hkv,G,Dh]
        blocks = jax.lax.dynamic_slice_in_dim(tables, j * cb, cb, axis=1)  # [T, cb]
        # The gathered chunk is small: computing on it in float32 keeps a bf16 cache off
        # XLA:CPU's slow bf16 dot paths (a quantized chunk is dequantized here, on read).
        k = kv_quant.gather(k_cache, _at(layer, blocks)).reshape(T, chunk, Hkv, Dh)  # [T, C, Hkv, Dh]
        v = kv_quant.gather(v_cache, _at(layer, blocks)).reshape(T, chunk, Hkv, Dh)
        s = jnp.einsum("thgd,tchd->thgc", qg, k)                # [T, Hkv, G, C]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kpos = j * chunk + jnp.arange(chunk, dtype=jnp.int32)  # [C]
        valid = (kpos[None, :] < kv_len[:, None]) & (kpos[None, :] >= lo[:, None])  # [T, C]
        s = jnp.where(valid[:, None, None, :], s, _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(axis=-1)
        acc = acc * corr[..., None] + jnp.einsum("thgc,tchd->thgd", p, v)
        return m_new, l, acc

    init = (jnp.full((T, Hkv, G), _MASK_VALUE, jnp.float32), jnp.zeros((T, Hkv, G), jnp.float32),
            jnp.zeros((T, Hkv, G, Dh), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, n_chunks, body, init)
    if sinks is not None:
        out = _with_sinks(m, l, acc, sinks.reshape(Hkv, G))
    else:
        out = acc / l[..., None]
    return out.reshape(T, Hq, Dh).astype(q.dtype)


def _with_sinks(m, l, acc, sinks):
    """The normalised output of an online softmax (running max m, sum l, accumulator acc,
    ``[..., G]`` / ``[..., G, Dh]``) whose denominator also holds ``exp(sink)`` per head:
    ``acc / (l + exp(sink - m))``, computed against the larger of m and the sink so that
    neither exponential overflows."""
    sinks = sinks.astype(jnp.float32)
    top = jnp.maximum(m, sinks)
    corr = jnp.exp(m - top)
    return acc * (corr / (l * corr + jnp.exp(sinks - top)))[..., None]


ATTENTION_IMPLS = ("xla", "pallas", "native")


def _pallas_attend(q, k, v, kv, layer, md, scale, sliding_window, soft_cap, sinks):
    k_cache, v_cache = kv
    splits = default_kv_splits(q.shape[0], md.seq_lens.shape[0], q.shape[1] // k.shape[1], k.shape[1],
                               md.block_tables.shape[1] * k_cache.shape[-3])
    o, k_cache, v_cache = ragged_paged_attention(
        q, k, v, k_cache, v_cache, md.seq_lens, md.block_tables, md.query_start_loc, layer=layer,
        sm_scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, visible_upto=md.visible_upto,
        kv_splits=splits)
    return o, (k_cache, v_cache)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, kv: KVCache, layer, md: AttentionMetadata, *,
           scale: float, sliding_window: int | None, soft_cap: float | None = None, sinks: jax.Array | None = None,
           backend: str = "xla") -> tuple[jax.Array, KVCache]:
    """Writes this step's K/V ``[T, Hkv, Dh]`` into the cache and attends: q [T, Hq, Dh] ->
    ([T, Hq, Dh], cache).  ``backend``: "xla" (scatter + :func:`paged_attention_xla`),
    "pallas" (one kernel that does both; interpret mode on CPU) or "native" (scatter + the
    CPU kernel of ``jaxllm/cpu/attention.py``, one device only).  The engine chose ``backend``
    and refused what cannot run (``engine/resolve.py``).  ``sliding_window``, ``soft_cap``
    (static) and ``sinks`` ([Hq] or None): see :func:`paged_attention_xla`."""
    feats = dict(sliding_window=sliding_window, soft_cap=soft_cap)
    if backend == "pallas":
        tp = tp_size()
        if tp > 1:
            # The kernel is opaque to XLA's partitioner: run it per device on that device's
            # heads (tensor parallelism splits q heads and KV heads alike).
            heads = P(None, TP, None)                               # [T, H, Dh]
            cache = P(*([None] * (kv[0].ndim - 2)), TP, None)        # [(L,) NB, BS, Hkv, Dh]
            layer_arg = () if layer is None else (layer,)           # a scanned layer's index is traced
            sink_arg = () if sinks is None else (sinks,)            # [Hq], split like the q heads

            def per_device(q, k, v, kv, md, *rest):
                li = rest[0] if layer_arg else None
                sk = rest[len(layer_arg)] if sink_arg else None
                return _pallas_attend(q, k, v, kv, li, md, scale, sliding_window, soft_cap, sk)
            fn = jax.shard_map(
                per_device,
                in_specs=(heads, heads, heads, (cache, cache), P(), *(P() for _ in layer_arg),
                          *(P(TP) for _ in sink_arg)),
                out_specs=(heads, (cache, cache)), check_vma=False)
            return fn(q, k, v, kv, md, *layer_arg, *sink_arg)
        return _pallas_attend(q, k, v, kv, layer, md, scale, sliding_window, soft_cap, sinks)
    if backend == "native":
        kv = write_kv(kv, layer, md.slot_mapping, k, v)
        return paged_attention_native(q, kv, layer, md, scale=scale, sinks=sinks, **feats), kv
    if backend != "xla":
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_IMPLS)}, got {backend!r}")
    tp = tp_size()
    if tp > 1:
        # Pin the new K/V and the cache to the cache's layout: left to itself, the partitioner
        # may split replicated KV heads like the query heads they serve and then gather the
        # whole cache back every step to match the donated layout.
        axis = kv_heads_axis(k.shape[1], tp)
        k, v = (jax.lax.with_sharding_constraint(a, P(None, axis, None)) for a in (k, v))   # [T, Hkv, Dh]
        kv = write_kv(kv, layer, md.slot_mapping, k, v)
        cache = P(*([None] * (kv[0].ndim - 2)), axis, None)
        kv = tuple(jax.lax.with_sharding_constraint(c, cache) for c in kv)
        return paged_attention_xla(q, kv, layer, md, scale=scale, sinks=sinks, **feats), kv
    kv = write_kv(kv, layer, md.slot_mapping, k, v)
    return paged_attention_xla(q, kv, layer, md, scale=scale, sinks=sinks, **feats), kv

"""Ragged paged attention as one Pallas kernel, with the step's K/V written into the pages.

One call serves a whole mixed batch: flat queries ``q [T, Hq, D]`` hold every sequence's
tokens of this step back to back (prefill chunks and single-token decodes alike),
``cu_q_lens [S + 1]`` says where each sequence's tokens start, ``kv_lens [S]`` how long its
KV is after this step, and ``page_table [S, P]`` where its pages are.  Sequence ``s`` has
``ctx = kv_lens[s] - q_len`` tokens already in the cache; its new tokens sit at positions
``ctx ...`` and attend causally to both, or, with ``visible_upto [T]`` (Gemma 3's image
tokens, which see their whole image), each as far as ``max(own position, visible_upto)``.

How the work is cut (everything static per bucket, so one compiled kernel per bucket):

* **Work items.**  Each sequence's queries are cut into blocks of ``block_q`` tokens; one
  item is one such block.  A batch of ``T`` tokens over ``S`` sequences has at most
  ``T // block_q + S`` items, computed on the device from ``cu_q_lens``.  The grid is
  ``(items, kv_heads, kv_splits)``; items past the real count do nothing.
* **GQA without padding heads.**  The ``G = Hq / Hkv`` query heads of a KV head and the
  item's ``block_q`` tokens are the rows of one matrix, ``M = block_q * G`` rows (rounded
  up to a power of two), so a decode batch of an 8:1 model fills 16 rows with 2 tokens,
  and no query head is ever padded.
* **Old and new keys apart.**  Keys at positions ``< ctx`` are read from the pages; the
  step's own keys are read from ``k_new``/``v_new`` directly.  A program therefore never
  reads a slot that this call writes, so the fused write needs no ordering between
  programs: each program (split 0) writes its item's K/V into the pages, and the cache
  is aliased input to output (updated in place).
* **Flash-decoding.**  With ``kv_splits > 1`` each split walks one share of a sequence's
  cached pages and returns an unnormalised partial (acc, max, sum); the wrapper merges
  them.  It pays when ``items * kv_heads`` programs are too few to fill the GPU and the
  contexts are long (decode of a few long sequences).

* **Quantized caches** (``--kv-cache-dtype``, ``formats/kv_pages.py``).  The wrapper
  quantizes the step's K/V once (as the XLA path's write does); the kernel dequantizes each
  page after its load (int8 values times their per-token scale, or fp8 widened) and the
  step's own quantized keys alike, so it computes on exactly what the cache holds, and
  its write copies the quantized rows and their scales.

The kernel uses the portable Pallas subset (ref indexing, ``pl.ds``, ``fori_loop``,
power-of-two blocks), so it lowers through Pallas' GPU backend and runs on CPU with
``interpret=True``, where the tests check it against :func:`ragged_paged_attention_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.formats import kv_pages

_MASK = -1e30   # finite: a split with no visible key keeps a finite max (weight exp(-huge) = 0)
# Pallas' GPU lowering runs a default-precision float32 dot in TF32 (10-bit mantissas): far
# outside 1e-5.  HIGHEST makes float32 dots IEEE there; bf16 dots are unaffected.
_EXACT = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


# ----------------------------------------------------------------------------- kernel

def _kernel(meta_ref, cu_ref, kv_lens_ref, pt_ref, layer_ref, q_ref, k_new_ref, v_new_ref, *refs,
            G: int, block_q: int, M: int, page: int, block_new: int, kv_splits: int,
            scale: float, window: int | None, soft_cap: float | None, kv_format: str | None = None,
            vis: bool = False):
    # kv_format: None (the cache in q's dtype), or a quantized cache's format; int8 brings
    # the scales of the new K/V, of the cache, and their outputs.  vis: the first of refs is
    # each query row's visible_upto [T * G + M] (laid out as q's rows); without it, causal.
    if vis:
        vis_ref, *refs = refs
    scaled = kv_format == "int8"
    if scaled:
        (ks_new_ref, vs_new_ref, k_cache_ref, v_cache_ref, ks_cache_ref, vs_cache_ref,
         acc_ref, m_ref, l_ref, k_out_ref, v_out_ref, ks_out_ref, vs_out_ref) = refs
    else:
        k_cache_ref, v_cache_ref, acc_ref, m_ref, l_ref, k_out_ref, v_out_ref = refs
    i, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s = meta_ref[0, i]            # sequence of this item
    q_first = meta_ref[1, i]      # flat index of its first query token
    q_count = meta_ref[2, i]      # query tokens in this item (0: an unused item)
    q_off = meta_ref[3, i]        # index of the first one within its sequence's new tokens
    layer = layer_ref[0]
    new_start = cu_ref[s]
    q_len = cu_ref[s + 1] - new_start
    ctx = kv_lens_ref[s] - q_len                                    # tokens already cached

    rows = jax.lax.broadcasted_iota(jnp.int32, (M, 1), 0)           # [M, 1]
    q_rel = q_off + rows // G                                       # [M, 1] query index in the sequence
    q = q_ref[h, pl.ds(q_first * G, M), :]                          # [M, D]
    D = q.shape[-1]
    # The last of this step's new tokens each row sees (index within the sequence's new ones):
    # itself, or with visible_upto as far ahead as its image ends (never less than itself).
    q_see = q_rel                                                   # [M, 1]
    if vis:
        q_see = jnp.maximum(q_rel, vis_ref[pl.ds(q_first * G, M)][:, None] - ctx)

    def dequant(x, sc):
        """Loaded rows [N, D] (and their int8 scales [N, 1]) -> q's dtype."""
        if kv_format is None:
            return x
        if sc is None:
            return kv_pages.dequantize(kv_pages.QuantPages(x, None, kv_format)).astype(q.dtype)
        return kv_pages.dequantize(kv_pages.QuantPages(x, sc, kv_format)).astype(q.dtype)

    # Running max and sum stay 1-D ([M]) and are broadcast with [:, None]: the GPU lowering
    # takes expand-dims but not every squeeze.
    def update(carry, k, v, visible):
        acc, m, l = carry                                           # [M, D], [M], [M]
        sc = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=_EXACT) * scale   # [M, N]
        if soft_cap is not None:
            sc = soft_cap * jnp.tanh(sc / soft_cap)
        sc = jnp.where(visible, sc, _MASK)
        m_new = jnp.maximum(m, sc.max(axis=1))
        p = jnp.where(visible, jnp.exp(sc - m_new[:, None]), 0.0)   # [M, N]
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(axis=1)
        acc = acc * corr[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32,
                                            precision=_EXACT)
        return acc, m_new, l

    carry = (jnp.zeros((M, D), jnp.float32), jnp.full((M,), _MASK, jnp.float32), jnp.zeros((M,), jnp.float32))

    # Cached keys: pages [first, n_pages), this split's share of them.
    n_pages = (ctx + page - 1) // page
    first = 0
    if window is not None:                          # pages wholly before every row's window
        first = jnp.clip(ctx + q_off - window + 1, 0, ctx) // page
    per = (n_pages - first + kv_splits - 1) // kv_splits
    lo = first + sp * per
    hi = jnp.minimum(lo + per, n_pages)
    kpos0 = jax.lax.broadcasted_iota(jnp.int32, (1, page), 1)       # [1, page]

    def old_body(j, carry):
        blk = pt_ref[s, j]
        k = dequant(k_cache_ref[layer, blk, :, h, :],               # [page, D]
                    ks_cache_ref[layer, blk, :, h, :] if scaled else None)
        v = dequant(v_cache_ref[layer, blk, :, h, :], vs_cache_ref[layer, blk, :, h, :] if scaled else None)
        kpos = j * page + kpos0                                     # [1, page]
        visible = (kpos < ctx) & (rows < block_q * G)               # [M, page]
        if window is not None:
            visible &= kpos > ctx + q_rel - window
        return update(carry, k, v, visible)

    carry = jax.lax.fori_loop(lo, hi, old_body, carry)

    # This step's keys (split 0 only): blocks of ``block_new`` up to the item's last query.
    knew0 = jax.lax.broadcasted_iota(jnp.int32, (1, block_new), 1)

    def new_body(j, carry):
        rows_new = pl.ds(new_start + j * block_new, block_new)
        k = dequant(k_new_ref[h, rows_new, :], ks_new_ref[h, rows_new, :] if scaled else None)  # [block_new, D]
        v = dequant(v_new_ref[h, rows_new, :], vs_new_ref[h, rows_new, :] if scaled else None)
        krel = j * block_new + knew0                                # [1, block_new]
        visible = (krel <= q_see) & (krel < q_len) & (rows < block_q * G)
        if window is not None:
            visible &= krel > q_rel - window
        return update(carry, k, v, visible)

    new_lo = 0
    if window is not None:
        new_lo = jnp.maximum(q_off - window + 1, 0) // block_new
    seen = q_off + q_count                                          # new tokens up to the item's last query
    if vis:                                                         # ... or as far as a row sees ahead
        ahead = jnp.max(jnp.where(rows < q_count * G, q_see, q_off + q_count - 1)) + 1
        seen = jnp.minimum(jnp.maximum(seen, ahead), q_len)
    new_hi = jnp.where(sp == 0, (seen + block_new - 1) // block_new, new_lo)
    acc, m, l = jax.lax.fori_loop(new_lo, new_hi, new_body, carry)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l

    # The fused cache write: split 0 stores this item's K/V rows into their pages.
    def write(t, carry):
        pos = ctx + q_off + t
        blk = pt_ref[s, pos // page]
        k_out_ref[layer, blk, pos % page, h, :] = k_new_ref[h, q_first + t, :]
        v_out_ref[layer, blk, pos % page, h, :] = v_new_ref[h, q_first + t, :]
        if scaled:
            ks_out_ref[layer, blk, pos % page, h, :] = ks_new_ref[h, q_first + t, :]
            vs_out_ref[layer, blk, pos % page, h, :] = vs_new_ref[h, q_first + t, :]
        return carry

    jax.lax.fori_loop(0, jnp.where(sp == 0, q_count, 0), write, None)


# ----------------------------------------------------------------------------- wrapper

def default_block_q(num_tokens: int, num_seqs: int, group: int) -> int:
    """Query tokens per item: 16 rows of queries for decode-heavy batches (the smallest
    dot a GPU's tensor cores take), 64 rows when prefill tokens dominate."""
    rows = 16 if num_tokens <= 2 * num_seqs else 64
    return max(1, rows // group)


def default_kv_splits(num_tokens: int, num_seqs: int, group: int, num_kv_heads: int, max_kv_len: int,
                      target_programs: int = 256, min_tokens_per_split: int = 512) -> int:
    """Flash-decoding splits for a bucket: enough programs to fill a GPU (an H100/H200 has 132
    SMs; two programs each), but never a split shorter than ``min_tokens_per_split`` keys,
    where the merge would cost more than the parallelism buys."""
    items = num_tokens // default_block_q(num_tokens, num_seqs, group) + num_seqs
    want = -(-target_programs // max(1, items * num_kv_heads))
    return max(1, min(want, max_kv_len // min_tokens_per_split))


def _work_items(cu_q_lens, block_q: int, num_items: int):
    """[4, N] int32: per item (sequence, first flat token, token count, offset in the sequence)."""
    S = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]                         # [S]
    n_blk = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(n_blk)                                        # [S]
    item = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, item, side="right"), S - 1).astype(jnp.int32)
    used = item < ends[-1]
    blk = item - (ends[seq] - n_blk[seq])
    q_off = blk * block_q
    count = jnp.where(used, jnp.clip(q_lens[seq] - q_off, 0, block_q), 0)
    first = jnp.where(used, cu_q_lens[seq] + q_off, 0)
    return jnp.stack([seq, first, count, jnp.where(used, q_off, 0)]).astype(jnp.int32)


def _call(q, k_new, v_new, k_cache, v_cache, kv_lens, page_table, cu_q_lens, layer, sinks, visible_upto, *, scale,
          window, soft_cap, kv_splits, block_q, interpret, num_warps, num_stages):
    T, Hq, D = q.shape
    Hkv = k_new.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    G = Hq // Hkv
    L, NB, page, _, _ = k_cache.shape
    S = kv_lens.shape[0]
    quant = isinstance(k_cache, kv_pages.QuantPages)
    fmt = k_cache.format if quant else None
    if block_q is None:
        block_q = default_block_q(T, S, G)
    M = pl.next_power_of_2(block_q * G)
    block_new = 16
    N = T // block_q + S
    meta = _work_items(cu_q_lens.astype(jnp.int32), block_q, N)

    # Queries as [Hkv, T * G (+ pad), D]: row t * G + g is token t, head h * G + g, so an item's
    # rows are one contiguous slice.  Padding keeps every block load in bounds.
    qr = q.reshape(T, Hkv, G, D).transpose(1, 0, 2, 3).reshape(Hkv, T * G, D)
    qr = jnp.pad(qr, ((0, 0), (0, M), (0, 0)))
    pad_new = lambda x: jnp.pad(x.transpose(1, 0, 2), ((0, 0), (0, block_new), (0, 0)))  # noqa: E731  [Hkv, T+, *]
    if quant:
        # Quantized once here, as the XLA path's write does; the kernel reads and stores these.
        (kn, kns), (vn, vns) = (kv_pages.quantize(x, fmt, k_cache.data.dtype) for x in (k_new, v_new))
        kn, vn = pad_new(kn), pad_new(vn)
        caches = [k_cache.data, v_cache.data]
        new_scales, cache_scales = ([pad_new(kns), pad_new(vns)], [k_cache.scale, v_cache.scale]) if kns is not None \
            else ([], [])
    else:
        kn, vn = pad_new(k_new.astype(k_cache.dtype)), pad_new(v_new.astype(v_cache.dtype))
        caches, new_scales, cache_scales = [k_cache, v_cache], [], []
    written = caches + cache_scales                                 # aliased to outputs 3...
    # visible_upto per query row, in qr's row order (token t's G rows), padded as qr is
    vis = [] if visible_upto is None else [jnp.pad(jnp.repeat(visible_upto.astype(jnp.int32), G), (0, M))]

    kernel = functools.partial(_kernel, G=G, block_q=block_q, M=M, page=page, block_new=block_new,
                               kv_splits=kv_splits, scale=scale, window=window, soft_cap=soft_cap, kv_format=fmt,
                               vis=bool(vis))
    whole = lambda shape: pl.BlockSpec(shape, lambda i, h, sp: (0,) * len(shape))  # noqa: E731
    extra = {}
    if not interpret:
        extra["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    first_written = 8 + len(vis) + len(new_scales)
    acc, m, l, *written = pl.pallas_call(
        kernel,
        grid=(N, Hkv, kv_splits),
        in_specs=[whole(meta.shape), whole(cu_q_lens.shape), whole(kv_lens.shape), whole(page_table.shape),
                  whole((1,)), whole(qr.shape), whole(kn.shape), whole(vn.shape),
                  *(whole(a.shape) for a in vis + new_scales + written)],
        out_specs=[pl.BlockSpec((None, None, None, M, D), lambda i, h, sp: (sp, i, h, 0, 0)),
                   pl.BlockSpec((None, None, None, M), lambda i, h, sp: (sp, i, h, 0)),
                   pl.BlockSpec((None, None, None, M), lambda i, h, sp: (sp, i, h, 0)),
                   *(whole(a.shape) for a in written)],
        out_shape=[jax.ShapeDtypeStruct((kv_splits, N, Hkv, M, D), jnp.float32),
                   jax.ShapeDtypeStruct((kv_splits, N, Hkv, M), jnp.float32),
                   jax.ShapeDtypeStruct((kv_splits, N, Hkv, M), jnp.float32),
                   *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in written)],
        input_output_aliases={first_written + j: 3 + j for j in range(len(written))},
        interpret=interpret,
        name=f"ragged_paged_attention_G{G}_bq{block_q}_p{page}_d{D}_s{kv_splits}" + (f"_{fmt}" if fmt else "")
        + ("_vis" if vis else ""),
        **extra,
    )(meta, cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32), page_table.astype(jnp.int32),
      jnp.reshape(layer, (1,)).astype(jnp.int32), qr, kn, vn, *vis, *new_scales, *written)
    if quant:
        scales = written[2:] or [None, None]
        k_cache, v_cache = (kv_pages.QuantPages(d, sc, fmt) for d, sc in zip(written[:2], scales))
    else:
        k_cache, v_cache = written

    # Merge the splits: weights exp(m_split - m_max); then back to flat token order.
    m_max = m.max(axis=0)                                           # [N, Hkv, M]
    w = jnp.exp(m - m_max[None])                                    # [P, N, Hkv, M]
    acc, l = (w[..., None] * acc).sum(axis=0), (w * l).sum(axis=0)  # [N, Hkv, M, D], [N, Hkv, M]
    if sinks is not None:
        # Attention sinks join the denominator only: one more term exp(sink) per row, taken
        # against the larger of the row's max and its sink.  Row r of a KV head's block is
        # query head h * G + r % G.
        sk = sinks.astype(jnp.float32).reshape(Hkv, G)[:, jnp.arange(M) % G]   # [Hkv, M]
        top = jnp.maximum(m_max, sk[None])
        corr = jnp.exp(m_max - top)
        acc, l = acc * corr[..., None], l * corr + jnp.exp(sk[None] - top)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    out = out[:, :, :block_q * G].reshape(N, Hkv, block_q, G, D).transpose(0, 2, 1, 3, 4)
    out = out.reshape(N * block_q, Hq, D)                           # [N * block_q, Hq, D]
    tok = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], tok, side="right"), S - 1)
    rel = tok - cu_q_lens[seq]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    first_item = jnp.cumsum((q_lens + block_q - 1) // block_q) - (q_lens + block_q - 1) // block_q
    slot = (first_item[seq] + rel // block_q) * block_q + rel % block_q
    real = tok < cu_q_lens[-1]
    out = jnp.where(real[:, None, None], out[jnp.where(real, slot, 0)], 0.0)
    return out.astype(q.dtype), k_cache, v_cache


def ragged_paged_attention(q, k_new, v_new, k_cache, v_cache, kv_lens, page_table, cu_q_lens, *,
                           layer=None, sm_scale: float | None = None, sliding_window: int | None = None,
                           soft_cap: float | None = None, sinks=None, visible_upto=None, kv_splits: int = 1,
                           block_q: int | None = None, interpret: bool | None = None, num_warps: int = 4,
                           num_stages: int = 2):
    """Attention of a ragged batch over a paged cache, writing the step's K/V into it.

    q [T, Hq, D]; k_new, v_new [T, Hkv, D] (this step's keys/values, same flat order);
    k_cache, v_cache [NB, page, Hkv, D], or stacked [L, NB, page, Hkv, D] with ``layer``
    (each an array, or a quantized cache's ``kv_pages.QuantPages`` of that shape);
    kv_lens [S] (KV length after this step; 0 for padding rows); page_table [S, P];
    cu_q_lens [S + 1] (padding rows repeat the last offset; tokens past ``cu_q_lens[-1]``
    are padding: no write, zero output).  ``sliding_window`` W: a token sees its last W
    positions; ``soft_cap`` c: scores ``c * tanh(s / c)``; ``sinks`` [Hq] (or None): a
    learned logit per query head in the softmax's denominator (GPT-OSS), applied where the
    splits merge; ``visible_upto`` [T] (or None: causal): token t sees up to position
    max(its own, visible_upto[t]) (the step must hold those keys: an image is never cut), the
    window still counting back from its own.  Returns (out [T, Hq, D], k_cache, v_cache).
    ``interpret`` None: interpret mode on CPU."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if kv_splits < 1:
        raise ValueError(f"kv_splits must be >= 1, got {kv_splits}")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [Hq] = [{q.shape[1]}], got {sinks.shape}")
    D = q.shape[-1]
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    stacked = k_cache.ndim == 5
    if stacked == (layer is None):
        raise ValueError("a stacked [L, ...] cache needs `layer`; a per-layer cache takes none")
    if not stacked:
        k_cache, v_cache = jax.tree.map(lambda a: a[None], (k_cache, v_cache))
        layer = 0
    out, k_cache, v_cache = _call(q, k_new, v_new, k_cache, v_cache, kv_lens, page_table, cu_q_lens,
                                  jnp.asarray(layer, jnp.int32), sinks, visible_upto, scale=scale, window=sliding_window,
                                  soft_cap=soft_cap, kv_splits=kv_splits, block_q=block_q,
                                  interpret=interpret, num_warps=num_warps, num_stages=num_stages)
    if not stacked:
        k_cache, v_cache = jax.tree.map(lambda a: a[0], (k_cache, v_cache))
    return out, k_cache, v_cache


ragged_paged_attention_jit = jax.jit(
    ragged_paged_attention, donate_argnums=(3, 4),
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "kv_splits", "block_q", "interpret",
                     "num_warps", "num_stages"))
"""The jitted entry point (the caches are donated: updated in place)."""


# ----------------------------------------------------------------------------- reference

def ragged_paged_attention_reference(q, k_new, v_new, k_cache, v_cache, kv_lens, page_table, cu_q_lens, *,
                                     layer=None, sm_scale: float | None = None,
                                     sliding_window: int | None = None, soft_cap: float | None = None,
                                     sinks=None, visible_upto=None):
    """Plain jnp, the oracle: scatter the new K/V, then dense masked softmax per token (a
    quantized cache: the new K/V quantized into it, then attention over its dequantized values);
    ``sinks`` [Hq]: a column of each head's sink logit joins the softmax and is dropped after it,
    as transformers' GPT-OSS eager attention does; ``visible_upto`` [T]: token t sees keys up to
    max(its position, visible_upto[t])."""
    T, Hq, D = q.shape
    stacked = k_cache.ndim == 5
    kc, vc = jax.tree.map(lambda a: a[layer], (k_cache, v_cache)) if stacked else (k_cache, v_cache)
    NB, page, Hkv, _ = kc.shape
    G = Hq // Hkv
    S = kv_lens.shape[0]
    scale = D ** -0.5 if sm_scale is None else sm_scale
    tok = jnp.arange(T)
    seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], tok, side="right"), S - 1)     # [T]
    real = tok < cu_q_lens[-1]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (tok - cu_q_lens[seq])                             # [T]
    blk = jnp.where(real, page_table[seq, pos // page], NB)                         # NB: dropped
    def put(c, x):
        if not isinstance(c, kv_pages.QuantPages):
            return c.at[blk, pos % page].set(x.astype(c.dtype), mode="drop")
        data, sc = kv_pages.quantize(x, c.format, c.data.dtype)
        return kv_pages.QuantPages(c.data.at[blk, pos % page].set(data, mode="drop"),
                                   None if sc is None else c.scale.at[blk, pos % page].set(sc, mode="drop"), c.format)

    def values(c):
        return kv_pages.dequantize(c) if isinstance(c, kv_pages.QuantPages) else c.astype(jnp.float32)

    kc, vc = put(kc, k_new), put(vc, v_new)
    P = page_table.shape[1]
    keys = values(kc)[page_table[seq]].reshape(T, P * page, Hkv, D)                # [T, K, Hkv, D]
    vals = values(vc)[page_table[seq]].reshape(T, P * page, Hkv, D)
    qg = q.astype(jnp.float32).reshape(T, Hkv, G, D)
    sc = jnp.einsum("thgd,tkhd->thgk", qg, keys) * scale                           # [T, Hkv, G, K]
    if soft_cap is not None:
        sc = soft_cap * jnp.tanh(sc / soft_cap)
    kpos = jnp.arange(P * page)[None, :]
    last = pos if visible_upto is None else jnp.maximum(pos, visible_upto)          # [T]
    visible = kpos <= last[:, None]
    if sliding_window is not None:
        visible &= kpos > pos[:, None] - sliding_window
    sc = jnp.where(visible[:, None, None, :], sc, -jnp.inf)
    if sinks is not None:
        col = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, Hkv, G, 1), (T, Hkv, G, 1))
        probs = jax.nn.softmax(jnp.concatenate([sc, col], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(sc, axis=-1)
    out = jnp.einsum("thgk,tkhd->thgd", probs, vals).reshape(T, Hq, D)
    out = jnp.where(real[:, None, None], out, 0.0).astype(q.dtype)
    if stacked:
        kc, vc = (jax.tree.map(lambda full, one: full.at[layer].set(one), full, one)
                  for full, one in ((k_cache, kc), (v_cache, vc)))
    return out, kc, vc


__all__ = ["ragged_paged_attention", "ragged_paged_attention_jit", "ragged_paged_attention_reference",
           "default_block_q"]

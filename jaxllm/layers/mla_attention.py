"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged cache of latents.

MLA compresses each token's keys and values into one latent ``c`` (``kv_lora_rank`` R values,
after ``kv_a_layernorm``) plus one rotary key ``k_pe`` (``qk_rope_head_dim`` Dr values) shared
by every head.  A head's key is ``[W_UK[h] c, k_pe]`` and its value ``W_UV[h] c``
(``kv_b_proj`` holds ``W_UK`` and ``W_UV`` per head), so the cache keeps only ``[c, k_pe]``:
R + Dr values per token and layer instead of H * (Dn + Dr + Dv) for the expanded K and V
(DeepSeek-V3: 576 against 40,960).

Attention is computed in the absorbed form: each query's no-rope part is projected into
latent space once (``q_lat[h] = W_UK[h]^T q_nope[h]``, ``[T, H, R]``), so a score is
``q_lat . c + q_pe . k_pe`` and the softmax-weighted sum of latents ``o_lat [T, H, R]``
becomes the head's output through ``W_UV[h]`` after the loop.  The loop over the context
reads one ``[C, R + Dr]`` page chunk per sequence for all heads (multi-query attention with
one KV head of width R + Dr whose first R values are also the value): a decode step reads
the latent cache and nothing else per token.  Prefill runs the same form (the expanded form
would do less arithmetic for long prompts; not implemented).

``paged_mla_xla`` is the XLA path and runs on every platform; ``mla_reference`` is the
plain, unpaged oracle of it and of the Pallas kernel (``pallas/mla_paged_attention.py``,
``--attention-backend pallas``).  ``--attention-backend native`` (the CPU default) runs the
native paged-attention kernel (``cpu/attention.cc``) as multi-query attention with one KV
head of width R + Dr that is both key and value: the absorbed form is exactly that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.cpu.attention import paged_attention_native
from jaxllm.layers import kv_quant
from jaxllm.layers.attention import AttentionMetadata, kv_chunk_tokens
from jaxllm.pallas.mla_paged_attention import paged_mla
from jaxllm.parallel.mesh import TP, tp_size

MLACache = tuple
"""``(pages,)``: each layer's latent pages ``[num_blocks, block_size, R + Dr]`` (the latent
first, then the rotated rope key), a list of per-layer arrays unrolled or one array
``[num_layers, num_blocks, block_size, R + Dr]`` stacked under ``lax.scan`` (the layout
reasons of ``layers/attention.KVCache``)."""

_MASK_VALUE = -1e30


def _at(layer, *index):
    return index if layer is None else (layer, *index)


def write_latent(pages: jax.Array, layer, slot_mapping: jax.Array, entry: jax.Array) -> jax.Array:
    """Scatters this step's ``[c, k_pe]`` entries ``[T, R + Dr]`` into ``layer``'s pages, in
    place (padding tokens write to the null block 0)."""
    BS = pages.shape[-2]
    return kv_quant.scatter(pages, _at(layer, slot_mapping // BS, slot_mapping % BS), entry)


def paged_mla_xla(q: jax.Array, pages: jax.Array, layer, md: AttentionMetadata, *, scale: float,
                  latent_dim: int) -> jax.Array:
    """q ``[T, H, R + Dr]`` (absorbed latent query, then the rotated rope query) -> o_lat
    ``[T, H, R]`` float32: softmax over positions ``[0, position]`` of the token's own
    sequence of ``scale * q . [c, k_pe]``, weighting the latents ``c``.  An online softmax
    over KV chunks, as far as the longest sequence of the batch."""
    T, H, C = q.shape
    BS = pages.shape[-2]
    chunk = kv_chunk_tokens(T, BS)
    cb = chunk // BS
    tables = md.block_tables[md.token_seq]                    # [T, MB]
    # At least two chunks of columns (see layers/attention.paged_attention_xla: a
    # loop-invariant gather would be hoisted and fused with the cache write).
    pad = max(2 * cb, -(-tables.shape[1] // cb) * cb) - tables.shape[1]
    if pad:
        tables = jnp.pad(tables, ((0, 0), (0, pad)))
    qs = q.astype(jnp.float32) * scale                        # [T, H, C]
    kv_len = md.positions + 1                                 # [T]
    n_chunks = (jnp.max(kv_len) + chunk - 1) // chunk

    def body(j, carry):
        m, l, acc = carry                                     # [T, H], [T, H], [T, H, R]
        blocks = jax.lax.dynamic_slice_in_dim(tables, j * cb, cb, axis=1)          # [T, cb]
        kv = kv_quant.gather(pages, _at(layer, blocks)).reshape(T, chunk, C)      # [T, Ck, R + Dr]
        s = jnp.einsum("thc,tkc->thk", qs, kv)               # [T, H, Ck]
        kpos = j * chunk + jnp.arange(chunk, dtype=jnp.int32)
        valid = kpos[None, :] < kv_len[:, None]               # [T, Ck]
        s = jnp.where(valid[:, None, :], s, _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(axis=-1)
        acc = acc * corr[..., None] + jnp.einsum("thk,tkr->thr", p, kv[..., :latent_dim])
        return m_new, l, acc

    init = (jnp.full((T, H), _MASK_VALUE, jnp.float32), jnp.zeros((T, H), jnp.float32),
            jnp.zeros((T, H, latent_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n_chunks, body, init)
    return acc / l[..., None]


def mla_reference(q: jax.Array, entries: jax.Array, positions: jax.Array, *, scale: float,
                  latent_dim: int) -> jax.Array:
    """The plain oracle of one sequence: q ``[T, H, R + Dr]``, entries ``[N, R + Dr]`` (its
    whole context), positions ``[T]`` -> ``[T, H, R]``, every score materialised."""
    s = jnp.einsum("thc,nc->thn", q.astype(jnp.float32) * scale, entries.astype(jnp.float32))
    valid = jnp.arange(entries.shape[0])[None, :] <= positions[:, None]       # [T, N]
    p = jax.nn.softmax(jnp.where(valid[:, None, :], s, -jnp.inf), axis=-1)
    return jnp.einsum("thn,nr->thr", p, entries[:, :latent_dim].astype(jnp.float32))


def attend_mla(q_lat: jax.Array, q_pe: jax.Array, latent: jax.Array, k_pe: jax.Array, pages: jax.Array, layer,
               md: AttentionMetadata, *, scale: float, backend: str = "xla") -> tuple[jax.Array, jax.Array]:
    """Writes this step's ``[c, k_pe]`` (latent ``[T, R]``, k_pe ``[T, Dr]``, rotated) into the
    pages and attends: q_lat ``[T, H, R]``, q_pe ``[T, H, Dr]`` -> (o_lat ``[T, H, R]``
    float32, pages).  ``backend`` "pallas": the kernel of ``pallas/mla_paged_attention.py``
    (per device on its heads under tensor parallelism; the pages are replicated); "native":
    the native CPU paged-attention kernel read as multi-query attention over the entries;
    "xla": :func:`paged_mla_xla`."""
    entry = jnp.concatenate([latent.astype(jnp.float32), k_pe.astype(jnp.float32)], axis=-1)   # [T, R + Dr]
    pages = write_latent(pages, layer, md.slot_mapping, entry)
    if backend == "pallas":
        return _pallas(q_lat, q_pe, pages, layer, md, scale), pages
    q = jnp.concatenate([q_lat.astype(jnp.float32), q_pe.astype(jnp.float32)], axis=-1)      # [T, H, R + Dr]
    R = latent.shape[-1]
    if backend == "native":
        # The native paged-attention kernel as multi-query attention: one KV head whose key
        # and value are both the whole entry (a free reshape of the pages), every query head
        # in its group; the value's rope columns come out too and are dropped (Dr / (R + Dr)
        # of the value work: 11% at DeepSeek's 512 + 64).
        one_head = pages[..., None, :]                                # [(L,) NB, BS, 1, R + Dr]
        out = paged_attention_native(q, (one_head, one_head), layer, md, scale=scale)   # [T, H, R + Dr]
        return out[..., :R], pages
    return paged_mla_xla(q, pages, layer, md, scale=scale, latent_dim=R), pages


def _pallas(q_lat, q_pe, pages, layer, md: AttentionMetadata, scale: float) -> jax.Array:
    def run(q_lat, q_pe, pages, md, *li):
        return paged_mla(q_lat, q_pe, pages, md.token_seq, md.positions, md.block_tables, scale=scale,
                         layer=li[0] if li else None)
    layer_arg = () if layer is None else (layer,)
    if tp_size() > 1:
        # The kernel is opaque to XLA's partitioner: each device runs its own heads over the
        # whole (replicated) pages.
        heads = P(None, TP, None)                                    # [T, H, *]
        return jax.shard_map(run, in_specs=(heads, heads, P(), P(), *(P() for _ in layer_arg)), out_specs=heads,
                             check_vma=False)(q_lat, q_pe, pages, md, *layer_arg)
    return run(q_lat, q_pe, pages, md, *layer_arg)

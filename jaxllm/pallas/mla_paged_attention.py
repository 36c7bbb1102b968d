"""Paged multi-head latent attention (MLA, DeepSeek-V2/V3) as one Pallas kernel.

The absorbed form of ``layers/mla_attention.py``: each query token brings its latent query
``q_lat [H, R]`` (the no-rope query folded through W_UK) and its rotated rope query ``q_pe
[H, Dr]``; its sequence's cached entries ``[c, k_pe]`` (``R + Dr`` values per token, shared
by every head) are read page by page, and the kernel returns the softmax-weighted sum of the
latents ``o_lat [H, R]`` (the model applies W_UV after it).

How the work is cut: one program per query token (grid ``(T,)``), its heads the rows of one
matrix (padded to a power of two, at least 16: the smallest dot the GPU lowering takes), so
every page a decode reads is read once for all heads.  Each page is loaded as its latent
columns ``[page, R]`` and its rope-key columns ``[page, Dr]`` (both powers of two for
DeepSeek: 512 and 64), the two score terms added.  The step's entries are written into the
pages before the call (``mla_attention.write_latent``, an XLA scatter), so the kernel only
reads the cache.  Prefill tokens run the same program per token (correct; a prefill-shaped
variant with query blocks is not written).

The portable Pallas subset (ref indexing, ``pl.ds``, ``fori_loop``), as
``pallas/ragged_paged_attention.py``: it lowers through Pallas' GPU backend and runs on CPU
with ``interpret=True``, where the tests check it against ``mla_attention.mla_reference``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_MASK = -1e30
_EXACT = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)   # IEEE float32 dots on the GPU lowering


def _kernel(seq_ref, pos_ref, pt_ref, layer_ref, q_lat_ref, q_pe_ref, pages_ref, o_ref, *,
            page: int, latent: int, rope: int, scale: float):
    t = pl.program_id(0)
    s = seq_ref[t]
    kv_len = pos_ref[t] + 1                                          # positions [0, position] visible
    layer = layer_ref[0]
    q_lat = q_lat_ref[t, :, :]                                       # [M, R]
    q_pe = q_pe_ref[t, :, :]                                         # [M, Dr]
    M = q_lat.shape[0]
    kpos0 = jax.lax.broadcasted_iota(jnp.int32, (1, page), 1)        # [1, page]

    def body(j, carry):
        acc, m, l = carry                                            # [M, R], [M], [M]
        blk = pt_ref[s, j]
        c = pages_ref[layer, blk, :, pl.ds(0, latent)]               # [page, R]
        k_pe = pages_ref[layer, blk, :, pl.ds(latent, rope)]        # [page, Dr]
        sc = (jnp.dot(q_lat, c.T, preferred_element_type=jnp.float32, precision=_EXACT)
              + jnp.dot(q_pe, k_pe.T, preferred_element_type=jnp.float32, precision=_EXACT)) * scale   # [M, page]
        visible = j * page + kpos0 < kv_len                          # [1, page]
        sc = jnp.where(visible, sc, _MASK)
        m_new = jnp.maximum(m, sc.max(axis=1))
        p = jnp.where(visible, jnp.exp(sc - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(axis=1)
        acc = acc * corr[:, None] + jnp.dot(p.astype(c.dtype), c, preferred_element_type=jnp.float32,
                                            precision=_EXACT)
        return acc, m_new, l

    init = (jnp.zeros((M, latent), jnp.float32), jnp.full((M,), _MASK, jnp.float32), jnp.zeros((M,), jnp.float32))
    acc, _, l = jax.lax.fori_loop(0, (kv_len + page - 1) // page, body, init)
    o_ref[...] = acc / jnp.maximum(l, 1e-30)[:, None]


def paged_mla(q_lat: jax.Array, q_pe: jax.Array, pages: jax.Array, token_seq: jax.Array, positions: jax.Array,
              block_tables: jax.Array, *, scale: float, layer=None, interpret: bool | None = None,
              num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """q_lat ``[T, H, R]``, q_pe ``[T, H, Dr]``; pages ``[NB, page, R + Dr]`` or stacked
    ``[L, NB, page, R + Dr]`` with ``layer``; token_seq, positions ``[T]``; block_tables
    ``[S, P]`` -> o_lat ``[T, H, R]`` float32 (token t attends to positions ``[0, positions[t]]``
    of sequence ``token_seq[t]``).  ``interpret`` None: interpret mode on CPU."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    T, H, R = q_lat.shape
    Dr = q_pe.shape[-1]
    stacked = pages.ndim == 4
    if stacked == (layer is None):
        raise ValueError("stacked [L, ...] pages need `layer`; per-layer pages take none")
    if not stacked:
        pages, layer = pages[None], 0
    if pages.shape[-1] != R + Dr:
        raise ValueError(f"pages hold {pages.shape[-1]} values per token, expected R + Dr = {R} + {Dr}")
    page = pages.shape[2]
    if not interpret and (min(R, Dr, page) < 16 or any(n & (n - 1) for n in (R, Dr, page))):
        raise ValueError(f"the compiled MLA kernel needs kv_lora_rank ({R}), qk_rope_head_dim ({Dr}) and the block "
                         f"size ({page}) to be powers of two of at least 16; use --attention-backend xla")
    M = max(16, pl.next_power_of_2(H))
    pad = ((0, 0), (0, M - H), (0, 0))
    ql = jnp.pad(q_lat.astype(pages.dtype), pad)                     # [T, M, R]
    qp = jnp.pad(q_pe.astype(pages.dtype), pad)                      # [T, M, Dr]
    args = (token_seq.astype(jnp.int32), positions.astype(jnp.int32), block_tables.astype(jnp.int32),
            jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), ql, qp, pages)
    whole = lambda shape: pl.BlockSpec(shape, lambda t: (0,) * len(shape))  # noqa: E731
    extra = {}
    if not interpret:
        extra["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    out = pl.pallas_call(
        functools.partial(_kernel, page=page, latent=R, rope=Dr, scale=float(scale)),
        grid=(T,),
        in_specs=[whole(a.shape) for a in args],
        out_specs=pl.BlockSpec((None, M, R), lambda t: (t, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((T, M, R), jnp.float32),
        interpret=interpret,
        name=f"paged_mla_p{page}_r{R}_dr{Dr}_m{M}",
        **extra,
    )(*args)
    return out[:, :H]


__all__ = ["paged_mla"]

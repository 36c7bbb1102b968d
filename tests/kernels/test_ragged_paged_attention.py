"""The ragged paged attention kernel against its plain-jnp reference, and the reference
against the engine's XLA path.

On CPU the kernel runs with ``interpret=True``; on a GPU (the device check runs this file
there too) the same tests run the compiled kernel.  Interpret mode fills every output
buffer with NaN before the kernel runs, so an output element the kernel forgot to write
shows up as a NaN (and as a mismatch).  Inputs are random, never zeros; the cache is
random too, so a write to a wrong slot or a read of a stale one cannot go unnoticed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.attention import AttentionMetadata, paged_attention_xla, write_kv
from jaxllm.pallas.ragged_paged_attention import (default_kv_splits, ragged_paged_attention,
                                                  ragged_paged_attention_reference)

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_batch(seed, q_lens, ctx_lens, *, Hq, Hkv, D, page, dtype=jnp.float32, pad_tokens=3, pad_rows=1,
               stacked_layers=None, spare_pages=5):
    """A ragged batch: sequence i has ctx_lens[i] cached tokens and q_lens[i] new ones; pages
    handed out in a random permutation; ``pad_tokens`` / ``pad_rows`` of bucket padding."""
    rng = np.random.default_rng(seed)
    S = len(q_lens) + pad_rows
    kv_lens = np.zeros(S, np.int32)
    kv_lens[:len(q_lens)] = np.asarray(ctx_lens) + np.asarray(q_lens)
    n_pages = [-(-int(n) // page) for n in kv_lens]
    P = max(max(n_pages), 1) + 1                    # a spare column, as the engine's tables have
    NB = sum(n_pages) + spare_pages
    perm = rng.permutation(np.arange(1, NB))        # page 0 is the engine's null block
    pt = np.zeros((S, P), np.int32)
    k = 0
    for s, n in enumerate(n_pages):
        pt[s, :n] = perm[k:k + n]
        k += n
    cu = np.zeros(S + 1, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = cu[len(q_lens)]
    T = int(cu[-1]) + pad_tokens

    def rand(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

    cache_shape = (NB, page, Hkv, D) if stacked_layers is None else (stacked_layers, NB, page, Hkv, D)
    return dict(q=rand(T, Hq, D), k_new=rand(T, Hkv, D), v_new=rand(T, Hkv, D),
                k_cache=rand(*cache_shape), v_cache=rand(*cache_shape),
                kv_lens=jnp.asarray(kv_lens), page_table=jnp.asarray(pt), cu_q_lens=jnp.asarray(cu))


_kernel = jax.jit(ragged_paged_attention, static_argnames=("sm_scale", "sliding_window", "soft_cap", "kv_splits",
                                                          "block_q", "interpret", "num_warps", "num_stages"))
_reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "sliding_window", "soft_cap"))

# One sink per query head (8 heads at most here), from far below the scores to far above.
SINKS = np.asarray([-30.0, -1.0, 0.0, 0.5, 3.0, 12.0, 2.0, -2.0], np.float32)


def check(batch, dtype=jnp.float32, layer=None, **kw):
    ref_kw = {k: v for k, v in kw.items() if k in ("sm_scale", "sliding_window", "soft_cap", "sinks", "visible_upto")}
    out, kc, vc = _kernel(**batch, layer=layer, **kw)
    r_out, r_kc, r_vc = _reference(**batch, layer=layer, **ref_kw)
    out, r_out = np.asarray(out, np.float32), np.asarray(r_out, np.float32)
    assert not np.isnan(out).any(), "an output element was never written (NaN poison survived)"
    err = np.abs(out - r_out).max() / np.abs(r_out).max()
    assert err <= TOL[dtype], f"max relative error {err:.3g} > {TOL[dtype]}"
    # Padding tokens get zeros; the cache holds exactly the reference's writes, nothing else moved.
    assert (out[int(batch["cu_q_lens"][-1]):] == 0).all()
    np.testing.assert_array_equal(np.asarray(kc, np.float32), np.asarray(r_kc, np.float32))
    np.testing.assert_array_equal(np.asarray(vc, np.float32), np.asarray(r_vc, np.float32))
    return out


# Lengths on and off page boundaries: decodes at 1 and right after a boundary, a prefill
# from nothing that ends on a boundary, a prefill chunk that resumes mid-page and straddles
# two boundaries, and a long decode context.
MIXED = dict(q_lens=[1, 1, 32, 21, 1, 5], ctx_lens=[0, 16, 0, 11, 70, 27])


# Each GQA ratio once, every head dim meeting both page sizes (4 cases of the 16 of the full
# product); each ratio meets the other head dim and page size in another test of this file:
# 1 (MHA) at 64 / 16 in test_quantized_cache_matches_reference[int8-1-64-16], 2 at 256 / 16 in test_head_dim_256, 4 at
# 128 / 32 in test_bfloat16[4-32], 8 at 64 / 32 in test_quantized_cache_matches_reference.
# The ratio sets the rows of a work item (block_q * G), the head dim and the page size the
# loads: independent parts of the kernel, which the product would not exercise any further.
PAIRWISE = [(1, 128, 32), (2, 64, 32), (4, 64, 16), (8, 128, 16)]


@pytest.mark.parametrize("group,head_dim,page", PAIRWISE)
def test_mixed_batch_matches_reference(group, head_dim, page):
    Hkv = 2
    check(make_batch(group * 10 + head_dim + page, **MIXED, Hq=Hkv * group, Hkv=Hkv, D=head_dim, page=page))


@pytest.mark.parametrize("q_lens,ctx_lens", [
    # One ragged batch (each sequence's output and writes are its own rows and pages), so
    # its prefill tokens set the prefill-sized work items (block_q 64 / G):
    ([1,                              # a one-token sequence
      16, 1, 1, 1,                    # around one page boundary (page 16): a page of prefill,
                                      # decodes to the boundary, after it and at 17
      3, 40],                         # chunks straddling one and several boundaries
     [0, 0, 15, 16, 17, 14, 9]),
    # A decode-only batch: the decode-sized work items (block_q 16 / G), decodes to, after
    # and past page boundaries.
    ([1] * 7, [3, 15, 16, 31, 32, 33, 100]),
], ids=["len1-page-straddle", "decodes"])
def test_lengths_around_page_boundaries(q_lens, ctx_lens):
    check(make_batch(len(q_lens) + sum(ctx_lens), q_lens, ctx_lens, Hq=6, Hkv=2, D=64, page=16))


def test_odd_gqa_ratio():
    # SmolLM2-135M is 9 query heads over 3 KV heads: G = 3 fills M = 5 * 3 rows of 16.  MHA
    # (G = 1) is test_mixed_batch_matches_reference[1-128-32].
    check(make_batch(1, **MIXED, Hq=9, Hkv=3, D=64, page=16))


def test_head_dim_256():
    check(make_batch(3, q_lens=[1, 9], ctx_lens=[20, 3], Hq=4, Hkv=2, D=256, page=16))


# bf16 over an odd group and a wide one, both page sizes (group 1 runs in float32 above).
@pytest.mark.parametrize("group,page", [(4, 32), (3, 16)])
def test_bfloat16(group, page):
    check(make_batch(4 + group, **MIXED, Hq=2 * group, Hkv=2, D=128, page=page, dtype=jnp.bfloat16), jnp.bfloat16)


# Two splits run in test_sliding_window and test_attention_sinks[2-9], three in
# test_attention_sinks[3-None] (the same batch and heads as here, with sinks).
@pytest.mark.parametrize("splits", [8])
def test_flash_decoding_splits(splits):
    # More splits than some sequences have pages: empty splits must merge with weight 0.
    check(make_batch(5, **MIXED, Hq=8, Hkv=2, D=64, page=16), kv_splits=splits)


# A window of one token and past two pages; one of a page (16) runs in
# test_soft_cap_and_scale, one inside a page (9) in test_attention_sinks[2-9] and
# test_quantized_cache_stacked_splits_and_window.
@pytest.mark.parametrize("window", [1, 40])
def test_sliding_window(window):
    check(make_batch(6, **MIXED, Hq=4, Hkv=2, D=64, page=16), sliding_window=window, kv_splits=2)


def test_soft_cap_and_scale():
    # With a window of one page (the cap bends the scores the window keeps).
    check(make_batch(7, **MIXED, Hq=4, Hkv=2, D=64, page=16), soft_cap=3.0, sm_scale=0.3, sliding_window=16)


@pytest.mark.parametrize("splits,window", [(1, None), (3, None), (2, 9)])
def test_attention_sinks(splits, window):
    # Sinks are merged with the splits' partials: split counts with empty splits, and a window.
    check(make_batch(14, **MIXED, Hq=8, Hkv=2, D=64, page=16), sinks=jnp.asarray(SINKS), kv_splits=splits,
          sliding_window=window, soft_cap=4.0 if window else None)


def test_block_q_choices():
    # Blocks of one token and of an odd count; the default for this batch (64 / 4 = 16)
    # runs in test_mixed_batch_matches_reference[4-64-16] and test_flash_decoding_splits.
    batch = make_batch(8, **MIXED, Hq=8, Hkv=2, D=64, page=16)
    for bq in (1, 3):
        check(batch, block_q=bq)


def test_stacked_cache_writes_only_its_layer():
    # The middle one of three layers (check(): the cache equals the reference's, whose write
    # touches layer 1 only), with sinks over an odd group (6 over 2: G = 3).
    batch = make_batch(9, **MIXED, Hq=6, Hkv=2, D=64, page=16, stacked_layers=3)
    check(batch, layer=jnp.int32(1), sinks=jnp.asarray(SINKS[:6]))


@pytest.mark.parametrize("features", [{}, dict(sliding_window=9, soft_cap=2.5, sinks=SINKS[:6], images=True)],
                         ids=["plain", "window-cap-sinks-images"])
def test_reference_equals_the_engine_xla_path(features):
    """The oracle computes the engine's function: scatter + paged_attention_xla on the same
    batch (with soft-capping, a window, sinks and image tokens' visible_upto too: the reference's
    sinks are transformers' extra softmax column, the XLA path's a term of the online softmax's
    denominator)."""
    b = make_batch(10, **MIXED, Hq=6, Hkv=2, D=64, page=16)
    cu, kv_lens, pt = (np.asarray(b[k]) for k in ("cu_q_lens", "kv_lens", "page_table"))
    T, S, page = b["q"].shape[0], kv_lens.shape[0], b["k_cache"].shape[1]
    seq = np.zeros(T, np.int32)
    pos = np.zeros(T, np.int32)
    slots = np.zeros(T, np.int32)
    for s in range(S):
        n = cu[s + 1] - cu[s]
        p = np.arange(kv_lens[s] - n, kv_lens[s])
        seq[cu[s]:cu[s + 1]], pos[cu[s]:cu[s + 1]] = s, p
        slots[cu[s]:cu[s + 1]] = pt[s, p // page] * page + p % page
    vis = with_images(b, IMAGE_SPANS, 17) if features.get("images") else None
    md = AttentionMetadata(positions=jnp.asarray(pos), slot_mapping=jnp.asarray(slots), token_seq=jnp.asarray(seq),
                           block_tables=b["page_table"], seq_lens=b["kv_lens"], query_start_loc=b["cu_q_lens"],
                           visible_upto=vis)
    sinks = features.get("sinks")
    static = {k: v for k, v in features.items() if k not in ("sinks", "images")}
    sinks = None if sinks is None else jnp.asarray(sinks)

    @jax.jit
    def xla_path(b, md, sinks):     # one program, not one per operation
        kv = write_kv((b["k_cache"], b["v_cache"]), None, md.slot_mapping, b["k_new"], b["v_new"])
        return paged_attention_xla(b["q"], kv, None, md, scale=64 ** -0.5, sinks=sinks, **static)

    xla = np.asarray(xla_path(b, md, sinks))
    ref, _, _ = _reference(**b, sinks=sinks, visible_upto=vis, **static)
    real = int(cu[-1])
    np.testing.assert_allclose(np.asarray(ref)[:real], xla[:real], rtol=1e-5, atol=1e-5)


def with_images(batch, spans, seed):
    """``visible_upto`` [T] for the batch: each (first, last) flat-token span is one image, all
    of whose tokens see up to its last position; any other token gets a value below its own
    position (-1 or position - 3), which must mean causal."""
    cu, kv_lens = np.asarray(batch["cu_q_lens"]), np.asarray(batch["kv_lens"])
    T = batch["q"].shape[0]
    pos = np.zeros(T, np.int32)
    for s in range(len(kv_lens)):
        n = cu[s + 1] - cu[s]
        pos[cu[s]:cu[s + 1]] = np.arange(kv_lens[s] - n, kv_lens[s])
    vis = np.where(np.random.default_rng(seed).random(T) < 0.5, -1, pos - 3).astype(np.int32)
    for a, b in spans:
        vis[a:b + 1] = pos[b]
    return jnp.asarray(vis)


# MIXED's flat tokens: sequence 2 is tokens 2-33 at positions 0-31, sequence 3 tokens 34-54 at
# 11-31, sequence 5 tokens 56-60 at 27-31.  Images: one across the kernel's 16-key block of new
# tokens and a query block's edge, one inside a chunk that resumes from cached pages, one at a
# chunk's end; decodes and text beside them.
IMAGE_SPANS = [(10, 25), (40, 44), (58, 60)]


def test_image_tokens_see_their_whole_image():
    # query blocks of 8 (an image spans items: each must reach ahead to its image's end), a
    # window of 5 (counted back from each token's own position) and two flash-decoding splits
    kw = dict(block_q=8, sliding_window=5, kv_splits=2)
    b = make_batch(13, **MIXED, Hq=4, Hkv=2, D=32, page=16)
    vis = with_images(b, IMAGE_SPANS, 14)
    out = check(b, visible_upto=vis, **kw)
    causal = np.asarray(_reference(**b, sliding_window=kw.get("sliding_window"))[0])
    ahead = np.concatenate([np.arange(a, c) for a, c in IMAGE_SPANS])   # image tokens before their last
    assert (np.abs(out[ahead] - causal[ahead]).max(axis=(1, 2)) > 1e-3).all(), "an image token attended causally"
    rest = np.setdiff1d(np.arange(int(b["cu_q_lens"][-1])), ahead)
    np.testing.assert_allclose(out[rest], causal[rest], rtol=1e-5, atol=1e-5)


def test_image_kernel_lowers_for_the_gpu(monkeypatch, capsys):
    # the visible_upto rows' load and the item's reach ahead lower through Pallas -> Triton too
    from jax.experimental import pallas as pl
    call = pl.pallas_call
    monkeypatch.setattr(pl, "pallas_call", lambda *a, **k: call(*a, **{**k, "debug": True}))
    b = make_batch(15, **MIXED, Hq=8, Hkv=2, D=64, page=16)
    f = jax.jit(lambda vis, **a: ragged_paged_attention(**a, visible_upto=vis, interpret=False, sliding_window=8))
    text = f.trace(with_images(b, IMAGE_SPANS, 16), **b).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "_vis" in capsys.readouterr().out


def test_kv_splits_heuristic():
    # A few long decodes on a GPU-sized bucket split; a big batch or a short context does not.
    assert default_kv_splits(4, 4, 8, 8, 32768) > 1
    assert default_kv_splits(256, 256, 8, 8, 32768) == 1
    assert default_kv_splits(4, 4, 8, 8, 256) == 1


def test_bad_arguments_are_refused():
    b = make_batch(11, [1], [3], Hq=4, Hkv=2, D=64, page=16)
    with pytest.raises(ValueError, match="kv_splits"):
        ragged_paged_attention(**b, kv_splits=0)
    with pytest.raises(ValueError, match="layer"):
        ragged_paged_attention(**b, layer=0)
    with pytest.raises(ValueError, match="multiple"):
        ragged_paged_attention(**{**b, "q": b["q"][:, :3]})
    with pytest.raises(ValueError, match="sinks"):
        ragged_paged_attention(**b, sinks=jnp.zeros((3,)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [dict(Hq=8, Hkv=2, D=128, page=16), dict(Hq=9, Hkv=3, D=64, page=32),
                                   dict(Hq=4, Hkv=4, D=256, page=16)], ids=["gqa4-d128", "gqa3-d64-p32", "mha-d256"])
def test_lowers_for_the_gpu(dtype, shape, monkeypatch, capsys):
    """Lowered for CUDA from this CPU: the Pallas -> Triton IR step runs here and refuses what
    the GPU backend cannot take (non-power-of-two blocks, unsupported squeezes, literal loop
    carries: a write loop returning a Python 0 failed exactly here).  The printed Triton
    module also shows the dots' input precision: a default-precision float32 dot is TF32
    there, far outside the 1e-5 the f32 tests hold the kernel to."""
    from jax.experimental import pallas as pl
    call = pl.pallas_call
    monkeypatch.setattr(pl, "pallas_call", lambda *a, **k: call(*a, **{**k, "debug": True}))
    b = make_batch(12, **MIXED, **shape, dtype=dtype)
    f = jax.jit(lambda **a: ragged_paged_attention(**a, interpret=False, kv_splits=2, sliding_window=8,
                                                   soft_cap=4.0))
    text = f.trace(**b).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
    triton = capsys.readouterr().out
    assert triton.count("tt.dot") >= 4 and "tf32" not in triton


# ----------------------------------------------------------------------------- quantized caches

def _quantize_batch(batch, name, platform="cpu"):
    from jaxllm.layers import kv_quant
    fmt = kv_quant.kv_format(name, platform)
    out = dict(batch)
    for c in ("k_cache", "v_cache"):
        out[c] = kv_quant.QuantPages(*kv_quant.quantize(batch[c], fmt, fmt.data_dtype), fmt.name)
    return out


# One format per shape (a diagonal, not the 9 of the product): the dequantization after a
# page load does not depend on the group or the head dim beyond what the float tests run;
# int8 and fp8_e4m3 also run stacked, split and windowed below, every format lowers for
# the GPU at the end of this file.
@pytest.mark.parametrize("name,group,head_dim,page", [("int8", 1, 64, 16), ("fp8_e4m3", 4, 128, 32),
                                                      ("fp8_e5m2", 8, 64, 32)])
def test_quantized_cache_matches_reference(name, group, head_dim, page):
    """The kernel dequantizes each page after its load and the step's own (quantized) keys;
    the reference quantizes the new K/V into the cache and attends over its dequantized
    values.  Same stored values on both sides: float32's tolerance, and the same pages,
    scales included, written."""
    from jaxllm.layers import kv_quant
    batch = _quantize_batch(make_batch(300 + group + head_dim + page, **MIXED, Hq=2 * group, Hkv=2, D=head_dim,
                                       page=page), name)
    out, kc, vc = _kernel(**batch)
    r_out, r_kc, r_vc = _reference(**batch)
    out, r_out = np.asarray(out), np.asarray(r_out)
    assert not np.isnan(out).any(), "an output element was never written (NaN poison survived)"
    err = np.abs(out - r_out).max() / np.abs(r_out).max()
    assert err <= TOL[jnp.float32], f"max relative error {err:.3g}"
    assert isinstance(kc, kv_quant.QuantPages) and kc.format == name
    for a, b in zip(jax.tree.leaves((kc, vc)), jax.tree.leaves((r_kc, r_vc))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The reference itself against float attention over the dequantized cache.
    f_out, f_kc, r_kc_deq = _float_attention_over_dequantized(batch, r_kc, name)
    np.testing.assert_allclose(r_out, np.asarray(f_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(r_kc_deq), np.asarray(f_kc))


@functools.partial(jax.jit, static_argnames="name")
def _float_attention_over_dequantized(batch, r_kc, name):
    """The float reference over the batch's dequantized cache and quantize-dequantized new
    K/V, and the reference's written K cache dequantized: one program, not one per operation."""
    from jaxllm.layers import kv_quant
    deq = lambda x: kv_quant.dequantize(kv_quant.QuantPages(*kv_quant.quantize(x, name, jnp.uint8 if "fp8" in name  # noqa: E731
                                                                               else None), name))
    fb = dict(batch, k_cache=kv_quant.dequantize(batch["k_cache"]), v_cache=kv_quant.dequantize(batch["v_cache"]),
              k_new=deq(batch["k_new"]), v_new=deq(batch["v_new"]))
    f_out, f_kc, _ = ragged_paged_attention_reference(**fb)
    return f_out, f_kc, kv_quant.dequantize(r_kc)


# Each format (int8 with its float scales, fp8_e4m3 with its byte table) reads a stacked
# cache; the splits and the window (static: a program each) run on one format each.
@pytest.mark.parametrize("name,kws", [("int8", (dict(layer=1, sliding_window=9),)),
                                      ("fp8_e4m3", (dict(layer=2, kv_splits=3),))], ids=["int8", "fp8_e4m3"])
def test_quantized_cache_stacked_splits_and_window(name, kws):
    batch = _quantize_batch(make_batch(410, **MIXED, Hq=4, Hkv=2, D=64, page=16, stacked_layers=3), name)
    for kw in kws:
        ref_kw = {k: v for k, v in kw.items() if k in ("layer", "sliding_window")}
        out, kc, vc = _kernel(**batch, **kw)
        r_out, r_kc, r_vc = _reference(**batch, **ref_kw)
        np.testing.assert_allclose(np.asarray(out), np.asarray(r_out), rtol=1e-5, atol=1e-5)
        for a, b in zip(jax.tree.leaves((kc, vc)), jax.tree.leaves((r_kc, r_vc))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantized_cache_lowers_for_the_gpu(name, dtype, monkeypatch, capsys):
    """The quantized kernel lowered for CUDA from this CPU, with the cache as a GPU holds it
    (fp8 as float8 arrays, int8 with float16 scales): the dequantization after each page
    load is taken by the Triton lowering."""
    from jax.experimental import pallas as pl
    call = pl.pallas_call
    monkeypatch.setattr(pl, "pallas_call", lambda *a, **k: call(*a, **{**k, "debug": True}))
    b = _quantize_batch(make_batch(13, **MIXED, Hq=8, Hkv=2, D=128, page=16, dtype=dtype), name, platform="gpu")
    f = jax.jit(lambda **a: ragged_paged_attention(**a, interpret=False, kv_splits=2))
    text = f.trace(**b).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
    triton = capsys.readouterr().out
    assert triton.count("tt.dot") >= 4

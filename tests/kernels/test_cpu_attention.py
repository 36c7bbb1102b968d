"""The native CPU paged attention (jaxllm/cpu/attention.cc) against the engine's XLA path.

Every batch is built the way the runner builds one: sequences with cached context and new
tokens, blocks handed out in a shuffled order, bucket padding (tokens at position 0 of a
padding row whose table is all null block 0, and padding rows).  The cache is random, not
zeros, and this step's K/V are scattered by ``write_kv`` first, so a read of a wrong slot,
of a position past the token or outside its window cannot go unnoticed.  Both paths read
the same stored values (for bf16 the same uint16 bits) and compute in float32, so bf16 is
held to the float32 tolerance too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.engines import ONE_SHOT_ENGINE
from support.tiny_models import paged_logits

from jaxllm.cpu import native
from jaxllm.formats import storage
from jaxllm.layers.attention import AttentionMetadata, attend, paged_attention_xla

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="native CPU kernel unavailable here (no AVX2/FMA or no C++ compiler)")

TOL = 1e-5


def make_batch(seed, q_lens, ctx_lens, *, Hq, Hkv, D, BS=16, cache="float32", pad_tokens=3, pad_rows=1,
               spare_blocks=7, layers=None):
    """Sequence i has ctx_lens[i] cached tokens and q_lens[i] new ones.  Returns (q, k, v,
    (k_cache, v_cache), md) as the runner would pass them to one layer's attention."""
    rng = np.random.default_rng(seed)
    n_seq = len(q_lens)
    S = n_seq + pad_rows
    kv_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    n_blocks = [-(-n // BS) for n in kv_lens]
    MB = max(n_blocks) + 1                          # a spare column, as the engine's tables have
    NB = sum(n_blocks) + spare_blocks + 1
    perm = rng.permutation(np.arange(1, NB))        # block 0 is the engine's null block
    tables = np.zeros((S, MB), np.int32)            # padding rows: all null block
    k = 0
    for s, n in enumerate(n_blocks):
        tables[s, :n] = perm[k:k + n]
        k += n
    seq, pos, slots = [], [], []
    for s, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        p = np.arange(c, c + n)
        seq += [s] * n
        pos += p.tolist()
        slots += (tables[s, p // BS] * BS + p % BS).tolist()
    pad_row = n_seq if pad_rows else 0
    seq += [pad_row] * pad_tokens
    pos += [0] * pad_tokens
    slots += [0] * pad_tokens                       # padding tokens write into the null block
    T = len(seq)
    qsl = np.zeros(S + 1, np.int32)
    qsl[1:n_seq + 1] = np.cumsum(q_lens)
    qsl[n_seq + 1:] = qsl[n_seq]
    seq_lens = np.zeros(S, np.int32)
    seq_lens[:n_seq] = kv_lens
    md = AttentionMetadata(positions=jnp.asarray(pos, jnp.int32), slot_mapping=jnp.asarray(slots, jnp.int32),
                           token_seq=jnp.asarray(seq, jnp.int32), block_tables=jnp.asarray(tables),
                           seq_lens=jnp.asarray(seq_lens), query_start_loc=jnp.asarray(qsl))

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    dtype = storage.PACKED_BF16 if cache == "bfloat16" else jnp.float32
    shape = (NB, BS, Hkv, D) if layers is None else (layers, NB, BS, Hkv, D)
    kv = tuple(storage.store(jnp.asarray(rand(*shape)), dtype) for _ in range(2))
    return jnp.asarray(rand(T, Hq, D)), jnp.asarray(rand(T, Hkv, D)), jnp.asarray(rand(T, Hkv, D)), kv, md


# One jitted function per (backend, static arguments): checks of the same shapes (the stacked
# cache's layers, which are traced) reuse its compiled programs instead of retracing.
@functools.cache
def _attend(backend, **kw):
    def f(q, k, v, kv, md, *li):
        return attend(q, k, v, kv, li[0] if li else None, md, backend=backend, **kw)
    return jax.jit(f)


@functools.cache
def _attend_sinks(backend, **kw):
    def f(q, k, v, kv, md, sinks, *li):
        return attend(q, k, v, kv, li[0] if li else None, md, backend=backend, sinks=sinks, **kw)
    return jax.jit(f)


def check(batch, *, sliding_window=None, layer=None, scale=None, soft_cap=None, sinks=None):
    """Both backends on the same batch (write_kv + attention); real tokens must agree and
    the kernel's output must be finite everywhere, padding included."""
    q, k, v, kv, md = batch
    kw = dict(scale=scale or q.shape[-1] ** -0.5, sliding_window=sliding_window, soft_cap=soft_cap)
    li = () if layer is None else (jnp.int32(layer),)
    if sinks is not None:
        want, kv_x = _attend_sinks("xla", **kw)(q, k, v, kv, md, sinks, *li)
        got, kv_n = _attend_sinks("native", **kw)(q, k, v, kv, md, sinks, *li)
    else:
        want, kv_x = _attend("xla", **kw)(q, k, v, kv, md, *li)
        got, kv_n = _attend("native", **kw)(q, k, v, kv, md, *li)
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.isfinite(got).all()
    real = int(md.query_start_loc[-1])              # padding tokens' outputs are not used
    err = np.abs(got[:real] - want[:real]).max() / np.abs(want[:real]).max()
    assert err < TOL, f"max relative error {err:.3g}"
    for a, b in zip(kv_n, kv_x):                    # the same write
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return got


# Decodes around block boundaries and past one 128-position chunk; a ragged prefill batch
# (a prompt from nothing, chunks resuming mid-block, a chunk straddling 128) with decodes.
DECODE = dict(q_lens=[1] * 8, ctx_lens=[0, 15, 16, 17, 31, 100, 127, 300])
MIXED = dict(q_lens=[1, 33, 7, 20, 1, 64], ctx_lens=[0, 0, 5, 120, 140, 70])
# Both in one ragged batch: each sequence's output depends only on its own row (the kernel's
# work items are (query tile, KV head) of one sequence), so one call proves for both kinds
# what two did.  Decode-only batches still run alone: test_decode_batch_of_32_like_smollm2,
# test_bfloat16_dtype_cache_is_taken_as_its_bits and the one-token chunks of
# test_prompt_token_is_the_same_bits_in_any_chunk_and_batch.
BOTH = dict(q_lens=DECODE["q_lens"] + MIXED["q_lens"], ctx_lens=DECODE["ctx_lens"] + MIXED["ctx_lens"])

# (Hq, Hkv, D): SmolLM2-135M (9 over 3 heads of 64), MHA, head dims that are not a
# multiple of 8 (with a 16-wide part and without), groups wider than one 4-head pass.
SHAPES = [(9, 3, 64), (4, 4, 32), (4, 2, 40), (6, 3, 20), (2, 1, 12), (5, 1, 64), (16, 2, 128), (3, 3, 4)]


# Each shape runs both kinds in one batch (BOTH), on one cache dtype alternating over the
# shapes: each dtype meets four shapes, both kinds, a head dim that is not a multiple of 8
# (float32 20 and 4, bf16 12) and one wider than a 16-lane part (float32 64, bf16 40, 64
# and 128).  The SmolLM2 shape (9, 3, 64) meets float32 in test_sliding_window,
# test_soft_cap and test_attention_sinks; (6, 2, 64) meets both dtypes in test_sliding_window.
# The dtype is a load (bf16 bits widened to float32) before the same arithmetic, independent
# of the head layout.
MATCH_CELLS = [(*shape, ("float32", "bfloat16")[(i + 1) % 2]) for i, shape in enumerate(SHAPES)]


@pytest.mark.parametrize("Hq,Hkv,D,cache", MATCH_CELLS,
                         ids=[f"hq{c[0]}-hkv{c[1]}-d{c[2]}-{c[3]}" for c in MATCH_CELLS])
def test_matches_xla_path(Hq, Hkv, D, cache):
    check(make_batch(Hq * 100 + D, **BOTH, Hq=Hq, Hkv=Hkv, D=D, cache=cache))


def test_decode_batch_of_32_like_smollm2():
    # The shape the kernel was built for: 32 decodes of ~100-token contexts, packed bf16.
    rng = np.random.default_rng(7)
    check(make_batch(7, [1] * 32, rng.integers(60, 160, 32).tolist(), Hq=9, Hkv=3, D=64, cache="bfloat16",
                     pad_tokens=0))


# The cache dtype alternates over the windows (each dtype meets a window shorter than a
# block, one of a block and one past the contexts), each window over decodes and a ragged
# prefill in one batch (BOTH), the heads alternating between 6 over 2 and 9 over 3 so that
# each dtype meets both; test_soft_cap runs float32 with a window of 16 too,
# test_attention_sinks bf16 with 7.
@pytest.mark.parametrize("window,cache,Hq,Hkv", [(1, "float32", 6, 2), (7, "bfloat16", 6, 2),
                                                 (16, "float32", 9, 3), (40, "bfloat16", 9, 3),
                                                 (200, "float32", 6, 2), (1, "bfloat16", 9, 3)])
def test_sliding_window(window, cache, Hq, Hkv):
    check(make_batch(20 + window, **BOTH, Hq=Hq, Hkv=Hkv, D=64, cache=cache), sliding_window=window)


@pytest.mark.parametrize("BS", [8, 32])
def test_other_block_sizes(BS):
    check(make_batch(40 + BS, **MIXED, Hq=6, Hkv=2, D=64, BS=BS))


def test_scale():
    check(make_batch(50, **MIXED, Hq=4, Hkv=2, D=64), scale=0.3)


# Each dtype meets the cap alone and under a window: bf16 here alone and with a window of 7
# in test_attention_sinks, float32 here with a window and alone (with sinks) in
# test_prompt_token_is_the_same_bits_in_any_chunk_and_batch[...-f32-softcap-sinks-...].
@pytest.mark.parametrize("cache,Hq,Hkv,cap,window,scale", [("float32", 9, 3, 2.0, 16, None),
                                                           ("bfloat16", 6, 2, 5.0, None, 1.0)],
                         ids=["float32-window", "bfloat16"])
def test_soft_cap(cache, Hq, Hkv, cap, window, scale):
    # A cap below the scores' spread (scale 1.0 gives scores of ~8): tanh bends most of them;
    # over decodes and a ragged prefill.
    check(make_batch(51, **BOTH, Hq=Hq, Hkv=Hkv, D=64, cache=cache), soft_cap=cap, sliding_window=window, scale=scale)


def test_attention_sinks():
    # Sinks from far below to far above the scores (a sink of +12 takes most of the weight,
    # the output shrinks towards 0), per head of a 3-wide group, with a window and in a stack;
    # decodes and a ragged prefill in each batch.
    sinks = jnp.asarray([-30.0, -1.0, 0.0, 0.5, 3.0, 12.0, 2.0, -2.0, 1.0], jnp.float32)   # [Hq]
    check(make_batch(53, **BOTH, Hq=9, Hkv=3, D=64), sinks=sinks)
    check(make_batch(54, **BOTH, Hq=9, Hkv=3, D=40, cache="bfloat16"), sinks=sinks, sliding_window=7, soft_cap=3.0)
    check(make_batch(55, **BOTH, Hq=9, Hkv=3, D=64, layers=2), sinks=sinks, layer=1)


def with_images(batch, spans, seed):
    """The batch with ``visible_upto`` [T]: each (first, last) flat-token span is one image whose
    tokens all see up to its last position; other tokens get a value below their position
    (-1 or position - 3 at random), which must mean causal (the max with the position)."""
    q, k, v, kv, md = batch
    pos = np.asarray(md.positions)
    vis = np.where(np.random.default_rng(seed).random(len(pos)) < 0.5, -1, pos - 3).astype(np.int32)
    for a, b in spans:
        vis[a:b + 1] = pos[b]
    return q, k, v, kv, dataclasses.replace(md, visible_upto=jnp.asarray(vis))


# Images inside ragged prefill chunks (MIXED: sequence 1 is flat tokens 1-33 at positions
# 0-32, sequence 3 tokens 41-60 at 120-139, sequence 5 tokens 62-125 at 70-133): one crossing
# the 32-position key tile, one crossing position 128, one of two tokens, one at a chunk's end,
# beside decodes and text; float32 alone, bf16 under a window of 5 (the window counts back from
# each token's own position, so an image token sees its window and the rest of its image).
@pytest.mark.parametrize("cache,window", [("float32", None), ("bfloat16", 5)])
def test_image_tokens_see_their_whole_image(cache, window):
    spans = [(20, 30), (47, 55), (62, 63), (118, 125)]
    batch = with_images(make_batch(80, **MIXED, Hq=6, Hkv=2, D=64, cache=cache), spans, 81)
    got = check(batch, sliding_window=window)
    q, k, v, kv, md = batch
    causal = np.asarray(_attend("xla", scale=64 ** -0.5, sliding_window=window, soft_cap=None)(
        q, k, v, kv, dataclasses.replace(md, visible_upto=None))[0])
    ahead = np.concatenate([np.arange(a, b) for a, b in spans])         # image tokens before their last
    assert (np.abs(got[ahead] - causal[ahead]).max(axis=(1, 2)) > 1e-3).all(), "an image token attended causally"
    rest = np.setdiff1d(np.arange(int(md.query_start_loc[-1])), ahead)
    np.testing.assert_allclose(got[rest], causal[rest], rtol=TOL, atol=TOL)


def test_sinks_shape_is_checked():
    from jaxllm.cpu.attention import paged_attention_native
    q, k, v, kv, md = make_batch(56, [1], [3], Hq=4, Hkv=2, D=64)
    with pytest.raises(ValueError, match="sinks must be"):
        paged_attention_native(q, kv, None, md, scale=0.1, sinks=jnp.zeros((3,)))


@pytest.mark.parametrize("layer", [0, 2])
def test_stacked_cache_reads_its_layer(layer):
    # The stacked cache (layers under lax.scan) is read at the traced layer's offset.
    check(make_batch(60 + layer, **MIXED, Hq=6, Hkv=2, D=64, layers=3), layer=layer)


def test_bfloat16_dtype_cache_is_taken_as_its_bits():
    q, k, v, (kc, vc), md = make_batch(70, **DECODE, Hq=4, Hkv=2, D=64, cache="bfloat16")
    as_bf16 = tuple(jax.lax.bitcast_convert_type(c, jnp.bfloat16) for c in (kc, vc))
    from jaxllm.cpu.attention import paged_attention_native
    a = paged_attention_native(q, (kc, vc), None, md, scale=0.125)
    b = paged_attention_native(q, as_bf16, None, md, scale=0.125)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want = paged_attention_xla(q, as_bf16, None, md, scale=0.125)
    np.testing.assert_allclose(np.asarray(a), np.asarray(want), rtol=TOL, atol=TOL)


def test_output_dtype_follows_q():
    from jaxllm.cpu.attention import paged_attention_native
    q, k, v, kv, md = make_batch(71, **DECODE, Hq=4, Hkv=2, D=64)
    out = paged_attention_native(q.astype(jnp.bfloat16), kv, None, md, scale=0.125)
    assert out.dtype == jnp.bfloat16


def test_bad_indices_stay_in_bounds():
    """Padding (and anything malformed) must not read outside the cache: out-of-range
    sequence rows, block ids and positions are clamped, a negative position reads nothing."""
    from jaxllm.cpu.attention import paged_attention_native
    q, k, v, kv, md = make_batch(72, **DECODE, Hq=4, Hkv=2, D=64)
    T = q.shape[0]
    NB = kv[0].shape[0]
    bad = AttentionMetadata(
        positions=jnp.asarray(np.resize([-5, 0, 10**6, 3], T), jnp.int32), slot_mapping=md.slot_mapping,
        token_seq=jnp.asarray(np.resize([-1, 99, 0, 2], T), jnp.int32),
        block_tables=md.block_tables.at[0].set(NB + 1000).at[1].set(-7), seq_lens=md.seq_lens,
        query_start_loc=md.query_start_loc)
    out = np.asarray(jax.jit(lambda q, kv, md: paged_attention_native(q, kv, None, md, scale=0.1))(q, kv, bad))
    assert np.isfinite(out).all()
    assert (out[0] == 0).all()                      # position -5: no visible key


def test_wrapper_refuses_what_the_kernel_cannot_take():
    # The engine never picks the kernel for such a cache (it refuses the flag, naming it:
    # test_resolution_of_the_attention_backend); the wrapper still refuses the call.
    from jaxllm.cpu.attention import paged_attention_native
    q, k, v, (kc, vc), md = make_batch(73, [1], [3], Hq=4, Hkv=2, D=64)
    with pytest.raises(ValueError, match="float32 or bfloat16, not float16"):
        paged_attention_native(q, (kc.astype(jnp.float16), vc.astype(jnp.float16)), None, md, scale=0.1)
    with pytest.raises(ValueError, match="stacked"):
        paged_attention_native(q, (kc, vc), 0, md, scale=0.1)


@pytest.mark.parametrize("what", ["head_dim", "heads", "token_seq", "v_cache"])
def test_kernel_rejects_mismatched_shapes(what):
    q, k, v, (kc, vc), md = make_batch(74, [1, 2], [3, 4], Hq=4, Hkv=2, D=64)
    args = dict(q=q, k=kc, v=vc, tables=md.block_tables, seq=md.token_seq, pos=md.positions)
    if what == "head_dim":
        args["q"] = q[..., :32]
    elif what == "heads":
        args["q"] = q[:, :3]
    elif what == "token_seq":
        args["seq"] = md.token_seq[:-1]
    else:
        args["v"] = vc[:-1]
    call = jax.ffi.ffi_call("jaxllm_paged_attention_f32", jax.ShapeDtypeStruct(args["q"].shape, jnp.float32))
    with pytest.raises(Exception, match="jaxllm_paged_attention"):
        np.asarray(call(*args.values(), jnp.int32(0), jnp.zeros((0,), jnp.float32), scale=np.float32(0.1),
                        sliding_window=np.int64(0), soft_cap=np.float32(0)))


def test_resolution_of_the_attention_backend(monkeypatch):
    from jaxllm.engine.resolve import _attention_backend
    assert _attention_backend("auto", "cpu", "float32", 1, False) == "native"
    assert _attention_backend("auto", "cpu", "bfloat16", 1, False) == "native"
    assert _attention_backend("auto", "cpu", "float32", 2, False) == "xla"     # tensor parallel
    assert _attention_backend("auto", "cpu", "float32", 1, True) == "xla"      # --scan-layers
    assert _attention_backend("auto", "cpu", "float16", 1, False) == "xla"
    assert _attention_backend("auto", "cuda", "bfloat16", 1, True) == "pallas"
    assert _attention_backend("native", "cpu", "float32", 1, True) == "native"
    for args in [("cuda", "bfloat16", 1, True), ("cpu", "float32", 2, False), ("cpu", "float16", 1, False)]:
        with pytest.raises(ValueError, match="--attention-backend"):
            _attention_backend("native", *args)
    with pytest.raises(ValueError, match="not --dtype float16; use --attention-backend xla"):
        _attention_backend("native", "cpu", "float16", 1, False)
    with pytest.raises(ValueError, match="does not shard; with --tensor-parallel-size > 1 use --attention-backend xla"):
        _attention_backend("native", "cpu", "float32", 2, False)
    monkeypatch.setattr(native, "available", lambda: False)
    assert _attention_backend("auto", "cpu", "float32", 1, False) == "xla"
    with pytest.raises(ValueError, match="--attention-backend xla"):
        _attention_backend("native", "cpu", "float32", 1, False)


# ----------------------------------------------------------------------------- bit-stability

def _prompt_md(tables, seq, pos):
    """Metadata of tokens (sequence seq[i] at position pos[i]) over the given block tables;
    the kernel reads only tables, token_seq and positions."""
    pos = jnp.asarray(pos, jnp.int32)
    S = tables.shape[0]
    return AttentionMetadata(positions=pos, slot_mapping=pos, token_seq=jnp.asarray(seq, jnp.int32),
                             block_tables=tables, seq_lens=jnp.zeros(S, jnp.int32),
                             query_start_loc=jnp.zeros(S + 1, jnp.int32))


@functools.cache
def _native_run(**kw):
    """The kernel jitted once per static configuration (sinks an argument): the whole and
    mixed calls of every chunk length share their programs."""
    from jaxllm.cpu.attention import paged_attention_native
    return jax.jit(lambda q, kv, md, sinks: paged_attention_native(q, kv, None, md, sinks=sinks, **kw))


def _prompt_outputs_three_ways(q, kv, tables, N, chunk, sinks=None, **kw):
    """Sequence 0's N prompt tokens through the kernel: whole, in chunks of ``chunk``, and
    as a chunk [5, N) beside another sequence's prefill chunk and decode tokens in one call.
    The cache already holds every position (as after the prompt's writes)."""
    run = functools.partial(_native_run(**kw), sinks=sinks)
    whole = np.asarray(run(q, kv, _prompt_md(tables, [0] * N, range(N))))
    chunks = [np.asarray(run(q[a:a + chunk], kv, _prompt_md(tables, [0] * len(q[a:a + chunk]), range(a, a + chunk)[:N - a])))
              for a in range(0, N, chunk)]
    other = jnp.asarray(np.random.default_rng(9).standard_normal((13,) + q.shape[1:]).astype(np.float32))
    mixed_q = jnp.concatenate([other[:10], q[5:], other[10:]])
    mixed_seq = [1] * 10 + [0] * (N - 5) + [1, 2, 1]
    mixed_pos = list(range(20, 30)) + list(range(5, N)) + [40, 3, 41]
    mixed = np.asarray(run(mixed_q, kv, _prompt_md(tables, mixed_seq, mixed_pos)))[10:10 + N - 5]
    return whole, np.concatenate(chunks), mixed


BITS_CASES = {   # (cache, features)
    "f32": ("float32", {}),
    "bf16-window": ("bfloat16", dict(sliding_window=40)),
    "f32-softcap-sinks": ("float32", dict(soft_cap=3.0, sinks=True)),
    "int8-window": ("int8", dict(sliding_window=33)),
    "fp8-sinks": ("fp8_e4m3", dict(sinks=True)),
}


# Each case runs every chunk length on one of the two shapes, alternating over the cases:
# the 9-over-3 shape takes f32, soft-cap with sinks and fp8, the one-KV-head 4-over-1 shape
# the bf16 and int8 windows (every case on one group width; both widths each meet a
# quantized cache and every chunk length).
BITS_SHAPES = [(9, 3, 64), (4, 1, 40)]
BITS_CELLS = [(*BITS_SHAPES[i % 2], case, chunk) for i, case in enumerate(BITS_CASES) for chunk in [1, 7, 32, 61]]


def _one_prompt(N, seed, Hq, Hkv, D, cache, *, rows, table_seed):
    """One sequence's N prompt tokens (q [N, Hq, D]) with the cache holding every position in
    the case's format, and ``rows`` block-table rows over the same pages (row 0 the prompt's,
    the others shuffled): other sequences reading them."""
    q, _, _, kv, md = make_batch(seed, [N], [0], Hq=Hq, Hkv=Hkv, D=D, cache="bfloat16" if cache == "bfloat16" else
                                 "float32", pad_tokens=0, pad_rows=0)
    if cache in QUANT:
        _, _, _, kv, _ = quantized((q, None, None, kv, md), cache)
    rng = np.random.default_rng(table_seed)
    t0 = np.asarray(md.block_tables)[0]
    return q, kv, jnp.asarray(np.stack([t0] + [rng.permutation(t0) for _ in range(rows - 1)]))


@pytest.mark.parametrize("Hq,Hkv,D,case,chunk", BITS_CELLS,
                         ids=[f"hq{c[0]}-hkv{c[1]}-d{c[2]}-{c[3]}-{c[4]}" for c in BITS_CELLS])
def test_prompt_token_is_the_same_bits_in_any_chunk_and_batch(Hq, Hkv, D, case, chunk):
    """A prompt token's attention output is the same bits whether its prompt is prefilled
    whole (query tiles of many tokens), in chunks of 1 (the decode path), 7, 32 or 61 tokens
    (tiles cut elsewhere), or beside another sequence's tokens: the engine's guarantee that a
    token's logits do not depend on the step it runs in.  Also equal to the XLA path."""
    # 161 tokens: chunks of 7 end flush, of 32 leave a last chunk of 1 (the decode program):
    # only the chunks of 61 add a tail program (39).
    N = 161
    cache, feats = BITS_CASES[case]
    # Sequences 1 and 2 read the same pages through other tables (their own rows of a batch).
    q, kv, tables = _one_prompt(N, 11 + D, Hq, Hkv, D, cache, rows=3, table_seed=3)
    kw = dict(scale=D ** -0.5, sliding_window=feats.get("sliding_window"), soft_cap=feats.get("soft_cap"))
    if feats.get("sinks"):
        kw["sinks"] = jnp.linspace(-2.0, 4.0, Hq, dtype=jnp.float32)
    whole, chunked, mixed = _prompt_outputs_three_ways(q, kv, tables, N, chunk, **kw)
    np.testing.assert_array_equal(chunked, whole)
    np.testing.assert_array_equal(mixed, whole[5:])
    want = np.asarray(paged_attention_xla(q, kv, None, _prompt_md(tables[:1], [0] * N, range(N)), **kw))
    err = np.abs(whole - want).max() / np.abs(want).max()
    assert err < TOL, f"max relative error {err:.3g}"


# Contexts over several of the kernel's key spans (attention.cc's kSpan, 256 positions): a
# decode of one or two sequences splits each KV head's walk into one item per span and merges
# their states after; a prefill (and a decode of many sequences) walks the spans in one item.
SPAN_CASES = [(9, 3, 64, "f32"), (9, 3, 64, "f32-softcap-sinks"), (4, 1, 40, "int8-window")]
SPAN_WINDOW = 300   # "int8-window" here: a window that crosses span boundaries


@pytest.mark.parametrize("Hq,Hkv,D,case", SPAN_CASES, ids=[c[3] for c in SPAN_CASES])
def test_decode_over_several_spans_is_the_same_bits_as_the_prefill(Hq, Hkv, D, case):
    """A token at a long context decoded alone (its spans as separate items, merged after),
    beside one other sequence (still split), or among eight (not split) gives the bits the
    same token gets inside its prompt's prefill (one walk over the spans), and stays within
    float32 rounding of the XLA path: the guarantee that a token's logits do not depend on
    the step it runs in, where the kernel parallelizes over the context."""
    N = 700   # positions 0 .. 699: spans [0, 256), [256, 512), [512, 700)
    cache, feats = BITS_CASES[case]
    q, kv, tables = _one_prompt(N, 31 + D, Hq, Hkv, D, cache, rows=8, table_seed=5)
    kw = dict(scale=D ** -0.5, sliding_window=SPAN_WINDOW if feats.get("sliding_window") else None,
              soft_cap=feats.get("soft_cap"))
    sinks = jnp.linspace(-2.0, 4.0, Hq, dtype=jnp.float32) if feats.get("sinks") else None
    run = functools.partial(_native_run(**kw), sinks=sinks)
    whole = np.asarray(run(q, kv, _prompt_md(tables, [0] * N, range(N))))
    for p in [255, 256, 511, 600, 699]:
        alone = np.asarray(run(q[p:p + 1], kv, _prompt_md(tables, [0], [p])))
        np.testing.assert_array_equal(alone[0], whole[p], err_msg=f"position {p} decoded alone")
        beside = np.asarray(run(jnp.concatenate([q[p:p + 1], q[:1]]), kv, _prompt_md(tables, [0, 1], [p, 400])))
        np.testing.assert_array_equal(beside[0], whole[p], err_msg=f"position {p} beside another sequence")
        among = np.asarray(run(jnp.concatenate([q[p:p + 1]] + [q[i:i + 1] for i in range(1, 8)]), kv,
                               _prompt_md(tables, list(range(8)), [p] + [300 + 50 * i for i in range(1, 8)])))
        np.testing.assert_array_equal(among[0], whole[p], err_msg=f"position {p} among eight sequences")
    want = np.asarray(paged_attention_xla(q, kv, None, _prompt_md(tables[:1], [0] * N, range(N)),
                                          sinks=sinks, **kw))
    err = np.abs(whole - want).max() / np.abs(want).max()
    assert err < TOL, f"max relative error {err:.3g}"


@pytest.fixture
def avx2_path():
    """The kernel's 8-lane AVX2 path for the test, the CPU's default restored after."""
    default = native.set_attention_avx512(True)
    native.set_attention_avx512(False)
    yield default
    native.set_attention_avx512(default)


@pytest.mark.parametrize("Hq,Hkv,D,case,chunk", [(9, 3, 64, "f32-softcap-sinks", 7), (4, 1, 40, "int8-window", 1)])
def test_avx2_path_keeps_the_guarantees(avx2_path, Hq, Hkv, D, case, chunk):
    """On a CPU with AVX-512 the tests above run its 16-lane path; this runs the AVX2 one
    (what a CPU without AVX-512 gets) through the same whole / chunked / mixed comparison,
    and checks that the two paths give the same bits (the 16-lane path does the 8-lane
    arithmetic lane for lane: which CPU runs a model must not change what it says)."""
    N = 161
    cache, feats = BITS_CASES[case]
    q, kv, tables = _one_prompt(N, 11 + D, Hq, Hkv, D, cache, rows=3, table_seed=3)
    kw = dict(scale=D ** -0.5, sliding_window=feats.get("sliding_window"), soft_cap=feats.get("soft_cap"))
    if feats.get("sinks"):
        kw["sinks"] = jnp.linspace(-2.0, 4.0, Hq, dtype=jnp.float32)
    whole, chunked, mixed = _prompt_outputs_three_ways(q, kv, tables, N, chunk, **kw)
    np.testing.assert_array_equal(chunked, whole)
    np.testing.assert_array_equal(mixed, whole[5:])
    want = np.asarray(paged_attention_xla(q, kv, None, _prompt_md(tables[:1], [0] * N, range(N)), **kw))
    assert np.abs(whole - want).max() / np.abs(want).max() < TOL
    if not avx2_path:
        print("no AVX-512 on this CPU: the AVX2 path is the default one, nothing to compare it with")
        return
    native.set_attention_avx512(True)
    wide = np.asarray(_native_run(**{k: v for k, v in kw.items() if k != "sinks"})(
        q, kv, _prompt_md(tables, [0] * N, range(N)), kw.get("sinks")))
    np.testing.assert_array_equal(wide, whole)


# The built-in model's steps as its engine runs them (tests/quant/test_builtin_int8.py): four
# prompts from nothing in one 32-token step (bucket padding after them), then their decodes;
# and a ragged batch with long prompts (whole key tiles, odd row counts, decodes beside).
ENGINE_STEPS = [dict(q_lens=[5, 6, 10, 5], ctx_lens=[0] * 4, pad_tokens=6), dict(q_lens=[1] * 4, ctx_lens=[5, 6, 10, 5]),
                dict(**BOTH, pad_tokens=3)]


def test_avx512_path_gives_the_avx2_paths_bits_on_the_builtin_models_steps(avx2_path):
    """SmolLM2-135M's shape (9 query heads over 3 KV heads of 64) on each cache format: the
    AVX-512 path's output is the AVX2 path's, bit for bit.  Summing 16 head dims per lane
    (the first AVX-512 scores) stayed within 5e-7 of a float64 reference, like the AVX2 path,
    but changed last bits, which int8 activations turned into 0.1-0.4 nat logit moves and
    another greedy token at the second token of a prompt."""
    if not avx2_path:
        pytest.skip("no AVX-512 on this CPU: the AVX2 path is the only one")
    run = _native_run(scale=0.125)
    for i, step in enumerate(ENGINE_STEPS):
        for fmt in ["float32", "bfloat16", "int8", "fp8_e4m3"]:
            batch = make_batch(70 + i, Hq=9, Hkv=3, D=64, cache="bfloat16" if fmt == "bfloat16" else "float32", **step)
            q, _, _, pages, md = quantized(batch, fmt) if fmt in QUANT else batch
            native.set_attention_avx512(False)
            narrow = np.asarray(run(q, pages, md, None))
            native.set_attention_avx512(True)
            wide = np.asarray(run(q, pages, md, None))
            np.testing.assert_array_equal(wide, narrow, err_msg=f"step {i}, {fmt} cache")


@pytest.mark.slow
def test_prompt_logits_are_the_same_bits_in_any_chunking():
    """End to end on the built-in model's default CPU path (packed weights through the native
    matmuls, native norms and attention): the logits of positions 8-40 are the same bits
    computed a token per step (the decode path) or in chunks of 7 (multi-token query tiles
    cut at 15, 22, 29 and 36: not at multiples of 8, and across the key tile boundary at 32).
    And computed in one 40-token step (a prefill chunk's many-row kernels).  The steps stay
    small: that the other kernels' bits do not depend on the step's shape is
    held for such steps by tests/quant/test_builtin_int8.py, whose ids and 8- and 1-token
    steps these are (the same programs: compile-cache hits in the suite; only the 7-token
    step is this test's own)."""
    from jaxllm.models.loader import load_model
    model = load_model(None)
    ids = [1] + list(range(300, 340))                # 41 tokens, as test_builtin_int8's IDS
    one = paged_logits(model, ids, False, split=tuple(range(8, 41)), matmul="native", attention="native")
    split = (8, 15, 22, 29, 36, 37, 38, 39, 40)      # 8, 7 x 4, then 1 x 5
    got = paged_logits(model, ids, False, split=split, matmul="native", attention="native")
    rows = np.nonzero(np.abs(got[8:] - one[8:]).max(-1))[0] + 8
    assert rows.tolist() == [], f"split {split}: positions whose logits differ: {rows.tolist()}"
    # A prefill's step: 40 tokens at once take the matmul's many-row path (the Q4_1 panels,
    # from 32 rows: cpu/quant_linear.cc) and the attention's 4-key score sums of whole tiles.
    whole = paged_logits(model, ids, False, split=(40,), matmul="native", attention="native")
    rows = np.nonzero(np.abs(whole[8:] - one[8:]).max(-1))[0] + 8
    assert rows.tolist() == [], f"a 40-token step: positions whose logits differ: {rows.tolist()}"


# The tiny checkpoints whose attention differs for the kernel: GQA 4 over 2 (the base),
# one KV head, MHA, a sliding window, head_dim 32.  qwen2_qkv_bias, qwen3_moe and mixtral
# are left out: their differences (q/k/v biases, MoE MLPs) happen outside the attention
# call, whose inputs have the base's shapes (qwen3_moe's those of qwen3_qk_norm); their
# engines run the default (native) attention against transformers in
# tests/models/test_hf_parity.py::test_greedy_tokens_match_transformers.
ATTENTION_VARIANTS = ["llama_gqa_untied", "llama3_rope_tied", "llama_linear_rope_mha", "mistral_sliding",
                      "qwen3_qk_norm"]


@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
def test_every_architecture_equals_the_xla_path(variant, tiny_checkpoints):
    """Each tiny checkpoint with its own attention shape (GQA, MHA, one KV head, head_dim 32,
    Mistral's sliding window of 16 under a 60-token prompt) gives the XLA path's logits with
    the native attention; the XLA path itself is held to transformers by
    tests/models/test_hf_parity.py.  Two chunks of 30 (the second reads the first's 30
    cached positions, the window of 16 cuts it): one program per backend."""
    ids = np.random.default_rng(1).integers(3, 5000, size=60).tolist()
    scan = variant == "llama_gqa_untied"             # one run of the stacked cache through lax.scan
    want = paged_logits(tiny_checkpoints[variant], ids, scan, split=30, attention="xla")
    got = paged_logits(tiny_checkpoints[variant], ids, scan, split=30, attention="native")
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 1e-5, f"{variant}: max relative logit error {rel:.2e}"


def test_engine_uses_the_native_attention_on_cpu(tiny_llm):
    # The default (--attention-backend auto) must pick the kernel on CPU; a silent fallback
    # to the XLA path would only show up as a slow benchmark.
    assert tiny_llm.llm_engine.core.resolved.step.kernels.attention == "native"
    text = tiny_llm.llm_engine.core.runner.compiler.steps[(1, 1)].compiled.as_text()
    arch = tiny_llm.llm_engine.core.runner.arch
    assert text.count("jaxllm_paged_attention") >= arch.num_layers


def test_engine_native_equals_the_xla_engine(tiny_llama, tiny_llm):
    """Greedy outputs of the default (native) engine equal the XLA-path engine's on a
    workload that batches prefill chunks with decodes and grows contexts past 128: four
    prompts (max_num_seqs) prefilled over eight full 32-token steps beside the decodes of
    those already prefilled, then decoded together to the same last step (max_tokens
    staggered by the step each prompt's prefill ends in), so the XLA engine runs the (32, 4)
    and (4, 4) buckets only."""
    from jaxllm import LLM, SamplingParams
    xla_llm = LLM(tiny_llama, **ONE_SHOT_ENGINE, attention_backend="xla")   # the buckets it runs
    assert xla_llm.llm_engine.core.resolved.step.kernels.attention == "xla"
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": rng.integers(3, 5000, size=int(n)).tolist()} for n in [3, 40, 70, 120]]
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in [40, 39, 37, 33]]
    want = [o.outputs[0].token_ids for o in xla_llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scan"])
def test_step_hlo_has_no_cache_copies(tiny_llama, scan_layers):
    """The custom call reads the cache buffer write_kv updated in place: no copy of it (see
    tests/runner/test_kv_in_place.py for the XLA path)."""
    import re
    from jaxllm.models.kernels import Kernels
    from jaxllm.models.loader import load_model
    from jaxllm.runner.model_runner import ModelRunner
    from jaxllm.runner.step_config import StepConfig
    model = load_model(tiny_llama)
    cfg = StepConfig(arch=model.arch, platform="cpu", dtype="float32", scan_layers=scan_layers, max_model_len=256,
                     max_num_seqs=4, max_num_batched_tokens=8, max_logprobs=2, kernels=Kernels(attention="native"))
    runner = ModelRunner(model, cfg, num_blocks=61, show_progress=False)
    a = model.arch
    layer_shape = f"61,16,{a.num_kv_heads},{a.head_dim}"
    shape = f"f32[{a.num_layers},{layer_shape}]" if scan_layers else f"f32[{layer_shape}]"
    T, S = runner.buckets[-1]
    hlo = runner.compiler.lower_step(runner.params, runner.kv, runner.sampler_rows.state, T, S).compile().as_text()
    assert "jaxllm_paged_attention" in hlo
    copies = [ln for ln in hlo.splitlines() if re.search(r"= " + re.escape(shape) + r"\{[0-9,]*\} copy\(", ln)]
    assert not copies, "the step copies the KV cache:\n" + "\n".join(copies[:3])


# ----------------------------------------------------------------------------- quantized caches

QUANT = ["int8", "fp8_e4m3", "fp8_e5m2"]


def quantized(batch, name):
    """The batch with its float cache quantized as the engine stores it on CPU."""
    from jaxllm.layers import kv_quant
    q, k, v, kv, md = batch
    fmt = kv_quant.kv_format(name, "cpu")
    pages = tuple(kv_quant.QuantPages(*kv_quant.quantize(c, fmt, fmt.data_dtype), fmt.name) for c in kv)
    return q, k, v, pages, md


def check_quant(batch, name, *, sliding_window=None, layer=None):
    """The kernel over a quantized cache against the XLA path over the same pages (which
    dequantizes the gathered chunks: tests/kernels/test_kv_quant.py holds it to float
    attention over the dequantized cache).  Both read the same stored values, so float32's
    tolerance applies; the write is XLA's in both."""
    q, k, v, kv, md = quantized(batch, name)
    kw = dict(scale=q.shape[-1] ** -0.5, sliding_window=sliding_window)
    li = () if layer is None else (jnp.int32(layer),)
    want, kv_x = _attend("xla", **kw)(q, k, v, kv, md, *li)
    got, kv_n = _attend("native", **kw)(q, k, v, kv, md, *li)
    got, want = np.asarray(got), np.asarray(want)
    assert np.isfinite(got).all()
    real = int(md.query_start_loc[-1])
    err = np.abs(got[:real] - want[:real]).max() / np.abs(want[:real]).max()
    assert err < TOL, f"max relative error {err:.3g}"
    for a, b in zip(jax.tree.leaves(kv_n), jax.tree.leaves(kv_x)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# Each shape runs one quantized format over decodes and a ragged prefill in one batch
# (BOTH), the formats rotated (int8 meets two shapes, the head dims 4 and 64);
# test_quantized_cache_sliding_window_and_stacked runs every format on the 6-over-2 shape
# with a window over a stack, and the bit-identity test below runs int8 and fp8_e4m3 on two
# more shapes.
QUANT_SHAPES = [(9, 3, 64), (4, 2, 40), (6, 3, 20), (3, 3, 4)]
QUANT_CELLS = [(*shape, QUANT[i % len(QUANT)]) for i, shape in enumerate(QUANT_SHAPES)]


@pytest.mark.parametrize("Hq,Hkv,D,name", QUANT_CELLS,
                         ids=[f"hq{c[0]}-hkv{c[1]}-d{c[2]}-{c[3]}" for c in QUANT_CELLS])
def test_quantized_cache_matches_xla_path(Hq, Hkv, D, name):
    check_quant(make_batch(Hq * 100 + D, **BOTH, Hq=Hq, Hkv=Hkv, D=D), name)


@pytest.mark.parametrize("name", QUANT)
def test_quantized_cache_sliding_window_and_stacked(name):
    # The window and the stacked layer's offset in one call (the window 40 cuts the contexts
    # of up to 210 positions; layer 2 of 3 is read at its offset, layers 0 and 1 never).
    check_quant(make_batch(82, **MIXED, Hq=6, Hkv=2, D=64, layers=3), name, sliding_window=40, layer=2)


def test_fp8_table_covers_every_byte():
    # Every one of the 256 bit patterns of each format, NaN and inf included, decoded as jnp
    # does: a token at position 0 sees one V row (weight exactly 1), so the output is that
    # row's decoded values; the 16 rows of 16 bytes are brought to offset 0 in turn.
    from jaxllm.cpu.attention import paged_attention_native
    from jaxllm.formats.kv_pages import FP8, QuantPages
    bits = np.arange(256, dtype=np.uint8).reshape(1, 16, 1, 16)           # [NB, BS, Hkv, Dh]
    md = AttentionMetadata(positions=jnp.array([0], jnp.int32), slot_mapping=jnp.array([0], jnp.int32),
                           token_seq=jnp.array([0], jnp.int32), block_tables=jnp.array([[0]], jnp.int32),
                           seq_lens=jnp.array([1], jnp.int32), query_start_loc=jnp.array([0, 1], jnp.int32))
    for name, f8 in FP8.items():
        want = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(bits), f8).astype(jnp.float32))[0, :, 0]
        k = QuantPages(jnp.zeros_like(jnp.asarray(bits)), None, name)
        got = np.stack([np.asarray(paged_attention_native(
            jnp.ones((1, 1, 16)), (k, QuantPages(jnp.asarray(np.roll(bits, -r, axis=1)), None, name)),
            None, md, scale=1.0))[0, 0] for r in range(16)])                # [16 rows, 16]
        np.testing.assert_array_equal(got, want)                           # NaN where NaN, +-inf where inf
        assert np.isnan(want).any() and (want != 0).sum() > 250                # the special patterns were met


def test_int8_kernel_rejects_mismatched_scales():
    q, k, v, kv, md = quantized(make_batch(75, [1, 2], [3, 4], Hq=4, Hkv=2, D=64), "int8")
    (kc, vc) = kv
    call = jax.ffi.ffi_call("jaxllm_paged_attention_int8", jax.ShapeDtypeStruct(q.shape, jnp.float32))
    args = lambda ks: (q, kc.data, vc.data, ks, vc.scale, md.block_tables, md.token_seq, md.positions,  # noqa: E731
                       jnp.int32(0), jnp.zeros((0,), jnp.float32))
    attrs = dict(scale=np.float32(0.1), sliding_window=np.int64(0), soft_cap=np.float32(0))
    np.asarray(call(*args(kc.scale), **attrs))     # the right shapes run
    for bad in (kc.scale[:-1], jnp.repeat(kc.scale, 2, axis=-1)):
        with pytest.raises(Exception, match="k_scale .* must be the cache's"):
            np.asarray(call(*args(bad), **attrs))

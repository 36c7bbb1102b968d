"""The gated delta rule (layers/gated_delta.py) and the short conv (layers/short_conv.py).

Oracles: the float64 token loop of ``reference_gated_delta_rule`` and transformers'
``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` / ``causal_conv1d_*``
(Qwen3-Next's modeling file), on random inputs whose decays span gentle to near-total.
Tolerances: float32 JAX against float64, 2e-5 absolute + 2e-5 relative on outputs and states
of magnitude ~1 (measured errors are ~1e-6; the chunked form's triangular solve is the loosest).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from jaxllm.cpu import native
from jaxllm.layers.gated_delta import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    reference_gated_delta_rule,
    segmented_gated_delta_rule,
    segments,
)
from jaxllm.layers.short_conv import conv_prefill, conv_prefill_ragged, conv_ragged_on_slots, conv_step
from jaxllm.runner.compile import enable_persistent_cache
from support.gated_delta_inputs import TOL
from support.gated_delta_inputs import random_inputs as _inputs


@pytest.fixture(scope="module", autouse=True)
def _persistent_xla_cache():
    # The engines' cache folder (conftest sets JAXLLM_CACHE_DIR): reruns skip the compiles.
    enable_persistent_cache(os.path.join(os.environ["JAXLLM_CACHE_DIR"], "xla"))


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), **TOL)


@pytest.mark.parametrize("T,chunk", [(37, 16), (5, 16), (64, 16), (1, 8), (50, 64)])
def test_chunked_recurrent_reference_agree(T, chunk):
    # Lengths not a multiple of the chunk (ragged tail), shorter than one chunk, and exact.
    q, k, v, g, beta, s0 = _inputs(T, T=T)
    o_ref, s_ref = reference_gated_delta_rule(q, k, v, g, beta, s0)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    assert o_c.shape == v.shape and s_c.shape == s0.shape
    _close(o_c, o_ref)
    _close(s_c, s_ref)
    _close(o_r, o_ref)
    _close(s_r, s_ref)


@pytest.mark.parametrize("T", [37, 70])
def test_against_transformers(T):
    q, k, v, g, beta, s0 = _inputs(100 + T, T=T)
    t = [torch.from_numpy(x) for x in (q, k, v, g, beta, s0)]
    o_hc, s_hc = hf.torch_chunk_gated_delta_rule(*t[:3], g=t[3], beta=t[4], chunk_size=16, initial_state=t[5],
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_hr, s_hr = hf.torch_recurrent_gated_delta_rule(*t[:3], g=t[3], beta=t[4], initial_state=t[5],
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=16)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    for got in (o_c, o_r):
        _close(got, o_hc.numpy())
        _close(got, o_hr.numpy())
    for got in (s_c, s_r):
        _close(got, s_hc.numpy())
        _close(got, s_hr.numpy())


def test_state_carries_across_calls():
    # A prefill split in two calls (the first ending mid-chunk) equals one call; decode
    # steps continuing the chunked prefill's state equal the reference over the whole run.
    q, k, v, g, beta, s0 = _inputs(7, T=45)
    o_all, s_all = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=16)
    cut = 21
    o1, s1 = chunk_gated_delta_rule(*(x[:, :cut] for x in (q, k, v, g, beta)), s0, chunk_size=16)
    o2, s2 = chunk_gated_delta_rule(*(x[:, cut:] for x in (q, k, v, g, beta)), s1, chunk_size=16)
    _close(jnp.concatenate([o1, o2], axis=1), o_all)
    _close(s2, s_all)
    s = s1
    outs = []
    for t in range(cut, 45):   # decode: one token per call
        o, s = recurrent_gated_delta_rule(*(x[:, t:t + 1] for x in (q, k, v, g, beta)), s)
        outs.append(o)
    _close(jnp.concatenate([o1, *outs], axis=1), o_all)
    _close(s, s_all)


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_padding_rows_leave_state_untouched(fn):
    # length [B]: rows padded past their real tokens give the state of their real tokens
    # alone, and zero outputs on the padding.
    q, k, v, g, beta, s0 = _inputs(11, T=30)
    length = np.array([30, 13], np.int32)
    run = ((lambda *a, **kw: chunk_gated_delta_rule(*a, chunk_size=8, **kw)) if fn == "chunk"
           else recurrent_gated_delta_rule)
    o, s = run(q, k, v, g, beta, s0, jnp.asarray(length))
    for b, n in enumerate(length):
        o_ref, s_ref = reference_gated_delta_rule(*(x[b:b + 1, :n] for x in (q, k, v, g, beta)), s0[b:b + 1])
        _close(o[b:b + 1, :n], o_ref)
        _close(s[b:b + 1], s_ref)
        assert np.all(np.asarray(o[b, n:]) == 0)


def test_no_l2norm_and_equal_heads():
    q, k, v, g, beta, s0 = _inputs(3, T=20, Hk=4, H=4)
    o_ref, s_ref = reference_gated_delta_rule(q, k, v, g, beta, s0, use_qk_l2norm=False, scale=0.3)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=8, use_qk_l2norm=False, scale=0.3)
    np.testing.assert_allclose(o_c, o_ref, atol=1e-4, rtol=1e-4)   # unnormalised keys: larger terms
    np.testing.assert_allclose(s_c, s_ref, atol=1e-4, rtol=1e-4)


def test_value_heads_must_group_key_heads():
    q, k, v, g, beta, s0 = _inputs(3, T=4, Hk=3, H=4)
    with pytest.raises(ValueError, match="multiple of key heads"):
        recurrent_gated_delta_rule(q, k, v, g, beta, s0)


# A ragged step's sequences: a prompt over three chunks, one-token decodes, one of exactly
# a chunk, an empty row, a short one last; T has 3 tokens of padding after them.
RAGGED_LENGTHS, RAGGED_T = [37, 1, 16, 0, 1, 5], 63


def _ragged(lengths, T):
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)          # [S + 1]
    token_seq = np.full(T, len(lengths) - 1, np.int32)
    for s, n in enumerate(lengths):
        token_seq[qsl[s]:qsl[s + 1]] = s
    return qsl, token_seq


def _need_native(backend):
    if backend == "native" and not native.available():
        pytest.skip("the native CPU kernels are unavailable here (no AVX2/FMA or no compiler): "
                    "the backend='native' form is not run")


def _ragged_step():
    """The ragged step's flat inputs: q, k, v, g, beta [T, ...] and query_start_loc."""
    q, k, v, g, beta, _ = _inputs(41, B=1, T=RAGGED_T)
    return (*(x[0] for x in (q, k, v, g, beta)), _ragged(RAGGED_LENGTHS, RAGGED_T)[0])


def test_segments_cover_each_sequence_in_chunks():
    qsl, _ = _ragged(RAGGED_LENGTHS, RAGGED_T)
    seq, start, length, first, last, count = (np.asarray(x) for x in segments(jnp.asarray(qsl), RAGGED_T, 16))
    assert len(seq) == -(-RAGGED_T // 16) + len(RAGGED_LENGTHS)
    used = length > 0
    assert count == 7 and used[:7].all()                                         # the used ones lead
    # 37 -> 16 + 16 + 5, then 1, 16, (none for the empty row), 1, 5: in order, nothing else
    assert list(zip(seq[used], start[used], length[used])) == [
        (0, 0, 16), (0, 16, 16), (0, 32, 5), (1, 37, 1), (2, 38, 16), (4, 54, 1), (5, 55, 5)]
    assert list(first[used]) == [True, False, False, True, True, True, True]
    assert list(last[used]) == [False, False, True, True, True, True, True]
    assert not first[~used].any() and not last[~used].any()


@pytest.mark.parametrize("backend", ["xla", "native"])
def test_segmented_form_equals_each_sequence_alone(backend):
    # Every sequence of a ragged step, from its own state, against the float64 token loop on
    # that sequence alone: outputs and final states.  The states are the engine's slots (more
    # rows than sequences, in another order): only the step's sequences' rows change, the
    # empty row's stays, and a fresh sequence starts from zeros whatever its row holds.
    # "native": the one-token sequences (1 and 4, one of them fresh) through the CPU kernel.
    _need_native(backend)
    lengths, T, C = RAGGED_LENGTHS, RAGGED_T, 16
    q, k, v, g, beta, qsl = _ragged_step()                                       # [T, ...]
    slots = np.array([7, 2, 0, 5, 8, 3])                                         # sequence -> its row
    fresh = np.array([False, False, True, False, True, False])
    s0 = np.random.default_rng(42).standard_normal((9, 4, 8, 6)).astype(np.float32) * 0.5
    seq, *seg, used = segments(jnp.asarray(qsl), T, C)
    o, states = segmented_gated_delta_rule(q, k, v, g, beta, s0, slots[np.asarray(seq)], *seg, used,
                                           fresh[np.asarray(seq)], chunk_size=C, backend=backend)
    o, states = np.asarray(o), np.asarray(states)                                # [T, H, Dv], [9, ...]
    for s, n in enumerate(lengths):
        row = slots[s]
        if n == 0:
            np.testing.assert_array_equal(states[row], s0[row])
            continue
        a = qsl[s]
        start = np.zeros_like(s0[row:row + 1]) if fresh[s] else s0[row:row + 1]
        o_ref, s_ref = reference_gated_delta_rule(*(x[None, a:a + n] for x in (q, k, v, g, beta)), start)
        _close(o[a:a + n], o_ref[0])
        _close(states[row], s_ref[0])
    for row in (1, 4, 6):                                                        # no sequence's
        np.testing.assert_array_equal(states[row], s0[row])
    assert np.all(o[qsl[-1]:] == 0)                                              # the padding's outputs


@pytest.mark.parametrize("backend", ["xla", "native"])
def test_segmented_form_runs_only_the_used_segments(backend):
    # The loop's bound is the step's segment count, not the N of the bound (a padded step's
    # unused segments cost nothing): told that only the first 2 segments exist, it leaves the
    # tokens after them zero and the states their later segments would write as given.
    _need_native(backend)
    q, k, v, g, beta, qsl = _ragged_step()
    T, C = RAGGED_T, 16
    s0 = np.random.default_rng(42).standard_normal((len(RAGGED_LENGTHS), 4, 8, 6)).astype(np.float32) * 0.5
    *seg, count = segments(jnp.asarray(qsl), T, C)
    o, states = segmented_gated_delta_rule(q, k, v, g, beta, s0, *seg, jnp.int32(2), np.zeros(len(seg[0]), bool),
                                           chunk_size=C, backend=backend)
    assert int(count) == 7
    assert np.abs(np.asarray(o[:32])).max(axis=(1, 2)).min() > 0 and np.all(np.asarray(o[32:]) == 0)
    np.testing.assert_array_equal(states, s0)          # sequence 0's last segment (the third) did not run


# ----------------------------------------------------------------------------- short conv

def test_conv_prefill_and_step_match_transformers():
    r = np.random.default_rng(5)
    B, T, C, K = 2, 11, 12, 4
    x = r.standard_normal((B, T, C)).astype(np.float32)
    w = r.standard_normal((C, K)).astype(np.float32)
    want = hf.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w), None,
                               activation="silu").transpose(1, 2).numpy()
    zero = jnp.zeros((B, K - 1, C), jnp.float32)
    y, _ = conv_prefill(x, w, zero)
    np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5)
    # Split prefill (7 + 4 tokens), then the one-token update, carry the state exactly.
    y1, s1 = conv_prefill(x[:, :7], w, zero)
    y2, s2 = conv_prefill(x[:, 7:10], w, s1)
    y3, s3 = conv_step(x[:, 10], w, s2)
    np.testing.assert_allclose(jnp.concatenate([y1, y2, y3[:, None]], axis=1), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(s3, x[:, -(K - 1):])
    # transformers' own decode update from the state of the first 10 tokens
    hf_state = torch.from_numpy(np.ascontiguousarray(x[:, 10 - K:10].transpose(0, 2, 1)))   # [B, C, K]
    hf_y = hf.causal_conv1d_update(torch.from_numpy(x[:, 10:11]).transpose(1, 2), hf_state,
                                   torch.from_numpy(w), None, "silu")
    np.testing.assert_allclose(y3, hf_y[:, :, 0].numpy(), atol=1e-5, rtol=1e-5)


def test_conv_state_with_padding():
    r = np.random.default_rng(6)
    B, T, C, K = 2, 9, 5, 4
    x = r.standard_normal((B, T, C)).astype(np.float32)
    w = r.standard_normal((C, K)).astype(np.float32)
    s0 = r.standard_normal((B, K - 1, C)).astype(np.float32)
    _, s = conv_prefill(x, w, s0, jnp.asarray([9, 2], np.int32))
    np.testing.assert_array_equal(s[0], x[0, -3:])
    np.testing.assert_array_equal(s[1], np.concatenate([s0[1, 2:], x[1, :2]]))   # 1 old + 2 new


def test_ragged_conv_is_the_rows_conv_bit_for_bit():
    # The flat ragged conv against conv_prefill on each sequence alone (its own state): the
    # same products summed in the same order, so equal bits; tokens shorter than the window
    # read the state, and the new state mixes old rows and new tokens.
    lengths, T = RAGGED_LENGTHS, RAGGED_T
    r = np.random.default_rng(7)
    C, K, S = 6, 4, len(lengths)
    x = r.standard_normal((T, C)).astype(np.float32)
    w = r.standard_normal((C, K)).astype(np.float32)
    s0 = r.standard_normal((S, K - 1, C)).astype(np.float32)
    qsl, token_seq = _ragged(lengths, T)
    y, state = conv_prefill_ragged(x, w, s0, jnp.asarray(qsl[:-1]), jnp.asarray(np.diff(qsl)), jnp.asarray(token_seq))
    for s, n in enumerate(lengths):
        a = qsl[s]
        y_s, st_s = conv_prefill(x[None, a:a + n], w, s0[s:s + 1])
        np.testing.assert_array_equal(np.asarray(y)[a:a + n], np.asarray(y_s)[0])
        np.testing.assert_array_equal(state[s], st_s[0])


@pytest.mark.parametrize("backend", ["xla", "native"])
def test_conv_on_slots_writes_each_sequences_row_only(backend):
    # The engine's conv step on every slot's state: each sequence's outputs and new row as
    # conv_prefill gives them on that sequence alone, from its row (zeros when fresh, whatever
    # the row holds); a padding sequence (out-of-range row) and rows no sequence owns untouched.
    _need_native(backend)
    lengths, T = RAGGED_LENGTHS, RAGGED_T        # sequence 3 has no token this step
    r = np.random.default_rng(8)
    C, K, R = 40, 4, 9                           # C: the kernel's 8-lane loops and a tail
    x = r.standard_normal((T, C)).astype(np.float32)
    w = r.standard_normal((C, K)).astype(np.float32)
    s0 = r.standard_normal((R, K - 1, C)).astype(np.float32)
    rows = np.array([7, 2, 0, 5, 9, 3], np.int32)   # sequence 4 is padding: row 9 is out of range
    fresh = np.array([False, False, True, False, False, False])
    s0[0] = np.nan                                   # the fresh sequence's row is never read
    qsl, token_seq = _ragged(lengths, T)
    y, states = conv_ragged_on_slots(x, w, jnp.asarray(s0), rows, jnp.asarray(qsl[:-1]), jnp.asarray(np.diff(qsl)),
                                     fresh, jnp.asarray(token_seq), backend=backend)
    y, states = np.asarray(y), np.asarray(states)
    for s, n in enumerate(lengths):
        if rows[s] >= R:
            continue
        a, own = qsl[s], np.zeros_like(s0[:1]) if fresh[s] else s0[rows[s]][None]
        y_s, st_s = conv_prefill(x[None, a:a + n], w, own)
        np.testing.assert_allclose(y[a:a + n], np.asarray(y_s)[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(states[rows[s]], np.asarray(st_s)[0])
    for row in (1, 4, 6, 8):
        np.testing.assert_array_equal(states[row], s0[row])

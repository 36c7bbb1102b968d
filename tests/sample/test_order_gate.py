"""Order gate: the parallel draw is bit-identical to the serial host reference.

The device sampler reduces in parallel (block maxima, candidate blocks, bitwise threshold
searches, XLA's own reduction trees); the reference in ``jaxllm/sample/reference.py`` walks
the vocabulary one element at a time.  Equal tokens over many widths, parameter mixes,
ties, masked entries, seeds and batch layouts show that the draw does not depend on the
order in which a reduction combines partial results, nor on the row or the bucket.

This gate catches a broken reduction order (e.g. a tie resolved to the later index, see
the last test) but not a broken noise *formula*: the reference shares the formula, so both
sides would agree on the wrong distribution.  That is the formula gate's job
(``test_formula_gate.py``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from support import sampler_harness
from support.sampler_harness import Row, device_tokens, reference_tokens, tie_pair

from jaxllm.sample import blocked, draw
from jaxllm.sample.metadata import RowParams

# Each width is a program of its own (~3 CPU-s to compile).  Widths inside one block of the
# argmax (blocked.BLOCK = 64: 2, 7, 64), padded to whole blocks (1000, 4099, 65537: one past
# 2^16) and whole blocks (49152, SmolLM2's vocabulary, and 151936, Qwen's).  Other whole-block
# vocabularies (32000, 128256, 248320) run the same unpadded path with another block count,
# which no reduction here depends on (max, min of indices, exact counts below 2^24).
WIDTHS = [2, 7, 64, 1000, 4099, 49152, 65537, 151936]
# Rows of gate_rows at a width of 4000 or more (ten paths and the tie row): the batch every
# device_tokens call below pads to, so that each width compiles one sampler program, shared
# by the tests (padding rows are greedy rows of the engine's buckets; the draw ignores them).
GATE_S = 11


def padded(rows: list[Row]) -> list[Row | None]:
    """``rows`` with padding rows after them, GATE_S in all."""
    assert len(rows) <= GATE_S, f"{len(rows)} rows do not fit the shared batch of {GATE_S}"
    return list(rows) + [None] * (GATE_S - len(rows))


def gate_rows(V: int, seed: int) -> list[Row]:
    """Rows exercising every path of the sampler at width V."""
    rng = np.random.default_rng(seed)
    seeds = [int(s) for s in rng.integers(0, 2**63, size=16, dtype=np.uint64)]

    def logits(scale=3.0):
        return (rng.standard_normal(V) * scale).astype(np.float32)

    rows = []
    # Greedy with the maximum repeated: the lowest index wins.
    lg = logits()
    top = rng.choice(V, size=min(3, V), replace=False)
    lg[top] = lg.max() + 1.0
    rows.append(Row(lg, RowParams(temperature=0.0)))
    # Plain temperature; top-k; top-p; min-p.
    rows.append(Row(logits(), RowParams(temperature=1.0, seed=seeds[0]), out_pos=3))
    rows.append(Row(logits(), RowParams(temperature=0.7, top_k=min(40, V), seed=seeds[1]), out_pos=11))
    rows.append(Row(logits(), RowParams(temperature=1.0, top_p=0.9, seed=seeds[2]), out_pos=0))
    rows.append(Row(logits(), RowParams(temperature=1.5, min_p=0.05, seed=seeds[3]), out_pos=7,
                    suppress=[int(t) for t in rng.choice(V, size=min(5, V), replace=False)]))
    # k beyond the candidate blocks, and a nucleus too wide for them: the full-row searches.
    rows.append(Row(logits(1.0), RowParams(temperature=1.0, top_k=min(3000, V), top_p=0.97, seed=seeds[4]),
                    out_pos=1))
    flat = np.full(V, 0.5, np.float32)
    flat[rng.choice(V, size=max(1, V // 3), replace=False)] = 0.25
    rows.append(Row(flat, RowParams(temperature=1.0, top_p=0.999, seed=seeds[5]), out_pos=2))
    # Top-k cutting through a tie group (set semantics: the whole group is kept).
    tied = np.round(logits(1.0)).astype(np.float32)
    rows.append(Row(tied, RowParams(temperature=0.9, top_k=min(7, V), seed=seeds[6]), out_pos=5))
    # Masked entries (allowed tokens), logit_bias, penalties over prompt and output counts.
    allowed = rng.choice(V, size=max(1, V // 2), replace=False)
    bias = np.full(V, -np.inf, np.float32)
    bias[allowed] = 0.0
    bias[allowed[:3]] += np.float32([2.5, -1.0, 0.75])[:min(3, allowed.size)]
    counts = np.zeros(V, np.int32)
    counts[rng.choice(V, size=min(20, V), replace=False)] = rng.integers(1, 5, size=min(20, V))
    prompt = np.zeros(V, bool)
    prompt[rng.choice(V, size=min(30, V), replace=False)] = True
    pen = RowParams(temperature=0.8, top_p=0.95, seed=seeds[7], repetition_penalty=1.3, presence_penalty=0.5,
                    frequency_penalty=0.25, bias_row=bias)
    rows.append(Row(logits(), pen, out_pos=9, counts=counts, prompt_mask=prompt))
    rows.append(Row(logits(), RowParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=-0.5,
                                        presence_penalty=1.5), counts=counts, prompt_mask=prompt))
    # Exact score ties: two entries with identical noise and identical logits, the rest masked.
    for t in range(64):
        pair = tie_pair(seeds[8], t, V) if V >= 4000 else None
        if pair is not None:
            b = np.full(V, -np.inf, np.float32)
            b[list(pair)] = 0.0
            rows.append(Row(np.zeros(V, np.float32), RowParams(temperature=1.0, seed=seeds[8], bias_row=b), out_pos=t))
            break
    return rows


@pytest.mark.parametrize("V", WIDTHS)
def test_parallel_draw_equals_the_serial_reference(V):
    for seed in (0, 1):
        rows = gate_rows(V, seed)
        assert device_tokens(rows) == reference_tokens(rows), f"V={V} seed={seed}"


@pytest.mark.parametrize("V", [49152, 151936])
def test_same_request_same_token_in_any_row_and_bucket(V):
    rows = gate_rows(V, 0)
    expect = reference_tokens(rows)
    # Rows reversed (every request in another row and another state slot), same bucket.
    assert device_tokens(rows[::-1]) == expect[::-1]
    if V == 49152:
        # Alone, one request per call (the S=1 bucket), and interleaved with padding rows in
        # a bigger bucket: at one width (a program per bucket and width).
        for i in (1, 3, 8, len(rows) - 1):
            assert device_tokens([rows[i]]) == [expect[i]]
        layout = [x for r in rows for x in (None, r)]
        assert device_tokens(layout)[1::2] == expect


def test_tie_rows_exist_and_resolve_to_the_lowest_index():
    rows = gate_rows(49152, 0)
    tie = rows[-1]
    assert np.isfinite(tie.params.bias_row).sum() == 2, "no tie row was built"
    lo = int(np.flatnonzero(np.isfinite(tie.params.bias_row))[0])
    assert reference_tokens([tie]) == device_tokens([tie]) == [lo]
    assert reference_tokens([rows[0]]) == [int(np.flatnonzero(rows[0].logits == rows[0].logits.max())[0])]


def test_sort_and_threshold_truncation_agree():
    for seed in (0, 1):
        rows = gate_rows(4099, seed)
        assert device_tokens(rows, sort_baseline=True) == device_tokens(rows) == reference_tokens(rows)


def test_float64_noise_draw_equals_the_reference():
    rows = gate_rows(49152, 3)
    assert device_tokens(rows, fp64=True) == reference_tokens(rows, fp64=True)


@pytest.fixture
def keep_compiled():
    """The harness' compiled sampler programs as they were before the test: a ``fresh`` call
    (which traces the mutated code) drops the cached program, and the tests after it would
    compile every width again."""
    saved = dict(sampler_harness._JIT)
    yield
    sampler_harness._JIT.update(saved)


def test_order_gate_sees_a_tie_break_the_formula_gate_cannot(monkeypatch, keep_compiled):
    """Mutation: resolve ties to the *last* index (what a reduction that keeps its right
    operand on equality would do).  The distribution is unchanged (exact ties have
    probability ~0, so the formula gate cannot notice), but the tie rows no longer match
    the serial reference."""
    rows = gate_rows(4099, 0)
    tie_rows = [rows[0], rows[-1]]
    assert np.isfinite(rows[-1].params.bias_row).sum() == 2, "no tie row was built"
    assert device_tokens(padded(tie_rows))[:2] == reference_tokens(tie_rows)
    _resolve_ties_to_the_last_index(monkeypatch)
    # The candidate draw's tie row rides in the same mutated program (one compile, not two):
    # test_candidate_draw_resolves_ties_to_the_lowest_index's mutation.
    cand_tie = truncated_rows(4099, 0)[-1]
    lo = int(np.flatnonzero(np.isfinite(cand_tie.params.bias_row))[0])
    got = device_tokens(padded(tie_rows + [cand_tie]), fresh=True)
    assert got[:2] != reference_tokens(tie_rows)
    assert got[2] != lo, "the candidate draw's tie does not go through the mutated reduction"


def _last_index(mask, index, big):
    import jax.numpy as jnp
    return jnp.max(jnp.where(mask, index, -1), axis=-1)


def _resolve_ties_to_the_last_index(monkeypatch):
    """The mutation, in every module whose reductions pick a first index."""
    for module in (blocked, draw):
        monkeypatch.setattr(module, "first_index", _last_index)


def truncated_rows(V: int, seed: int) -> list[Row]:
    """Batches whose random rows all use top-k / top-p with a narrow nucleus: the sampler then
    draws from the threshold search's candidates only (``draw_candidates``), not the row."""
    base = gate_rows(V, seed)
    rows = [r for r in base if r.params.temperature == 0.0 or r.params.top_k in (7, 40)]
    # Top-p over peaked logits (as a language model's are): a nucleus of a few entries.
    rng = np.random.default_rng(seed)
    for p in (0.8, 0.95):
        peaked = (rng.standard_normal(V) * 12.0).astype(np.float32)
        rows.append(Row(peaked, RowParams(temperature=1.0, top_p=p, seed=int(rng.integers(2**62))), out_pos=4))
    tie = base[-1]
    if np.isfinite(tie.params.bias_row).sum() == 2:
        # The exact tie, with top-k keeping both entries: the lower index must win here too.
        rows.append(Row(tie.logits, dataclasses.replace(tie.params, top_k=2), out_pos=tie.out_pos))
    return rows


@pytest.mark.parametrize("V", [4099, 49152, 65537, 151936])     # programs of test_parallel_draw...
def test_candidate_draw_equals_the_serial_reference(V):
    for seed in (0, 1, 2):
        rows = truncated_rows(V, seed)
        n = len(rows)
        assert sum(r.params.temperature > 0 for r in rows) >= 4
        assert device_tokens(padded(rows))[:n] == reference_tokens(rows), f"V={V} seed={seed}"
        assert device_tokens(padded(rows[::-1]))[:n] == reference_tokens(rows)[::-1]


def test_candidate_draw_resolves_ties_to_the_lowest_index():
    # The same row under the mutation (ties to the last index) draws another token: in
    # test_order_gate_sees_a_tie_break_the_formula_gate_cannot's mutated program.
    rows = truncated_rows(4099, 0)
    tie = rows[-1]
    assert tie.params.top_k == 2 and np.isfinite(tie.params.bias_row).sum() == 2, "no tie row was built"
    lo = int(np.flatnonzero(np.isfinite(tie.params.bias_row))[0])
    assert device_tokens(padded([tie]))[:1] == reference_tokens([tie]) == [lo]

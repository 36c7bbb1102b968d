"""The sampler's per-request device state: rows keyed by request id, counts updated inside the
step and never rebuilt from the host, buffers donated and updated in place; and the
logprobs modes."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jaxllm import SamplingParams
from jaxllm.engine.output_processor import OutputKind
from jaxllm.sample import metadata as smd
from jaxllm.sample import sampler as sm
from support.sampler_harness import one_row as _one_row


def test_step_updates_the_state_in_place(tiny_llm):
    runner = tiny_llm.llm_engine.core.runner
    R, V = runner.sampler_rows.state.counts.shape
    for bucket, program in runner.compiler.steps.items():
        hlo = program.compiled.as_text()
        for dt in ("s32", "pred", "f32"):
            copies = [ln for ln in hlo.splitlines() if re.search(rf"= {dt}\[{R},{V}\]\{{[0-9,]*\}} copy\(", ln)]
            assert not copies, f"bucket {bucket} copies a sampler state buffer:\n" + "\n".join(copies[:2])
        # Every KV buffer and the three state buffers are donated: aliased to an output.
        header = hlo.splitlines()[0]
        n_alias = len(re.findall(r"(may|must)-alias\)", header))
        assert n_alias == len(jax.tree.leaves(runner.kv)) + 3, header[:300]
    # The sampler (its own program per sequence bucket) reads the state without copying it.
    assert runner.compiler.samplers
    for S, program in runner.compiler.samplers.items():
        hlo = program.compiled.as_text()
        for dt in ("s32", "pred", "f32"):
            copies = [ln for ln in hlo.splitlines() if re.search(rf"= {dt}\[{R},{V}\]\{{[0-9,]*\}} copy\(", ln)]
            assert not copies, f"sampler {S} copies a sampler state buffer:\n" + "\n".join(copies[:2])


def test_counts_live_on_the_device_keyed_by_request_id(tiny_llm):
    engine = tiny_llm.llm_engine
    runner = engine.core.runner
    sp = SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True, frequency_penalty=0.4)
    prompt = [5, 9, 9, 40, 41, 42, 9, 7]
    engine.add_request("state-a", {"prompt_token_ids": prompt}, sp, kind=OutputKind.CUMULATIVE)
    engine.add_request("state-b", {"prompt_token_ids": [3, 4]}, sp.replace(seed=12), kind=OutputKind.CUMULATIVE)
    outs = {}
    for _ in range(6):
        for o in engine.step():
            outs[o.request_id] = o.outputs[0].token_ids
    rows = runner.sampler_rows
    row_a = rows.row("state-a")
    counts = np.asarray(rows.state.counts[row_a])
    pmask = np.asarray(rows.state.prompt_mask[row_a])
    out = outs["state-a"]
    # Every output token fed back through a step is counted there: all but the newest when
    # steps run one at a time; all of them under async scheduling, whose next step (already
    # dispatched when ``step()`` returns) took the newest as its input.
    fed = out if engine.core.async_scheduling else out[:-1]
    assert np.array_equal(counts, np.bincount(fed, minlength=counts.shape[0]))
    assert set(np.flatnonzero(pmask).tolist()) == set(prompt)
    row_b = rows.row("state-b")
    assert row_b != row_a
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()                     # delivers the finished ids: the runner frees their rows
    with pytest.raises(KeyError):
        rows.row("state-a")
    # A new request reuses a freed row (which held a's or b's counts), and starts from zero.
    engine.add_request("state-c", {"prompt_token_ids": [8]}, sp.replace(seed=13), kind=OutputKind.CUMULATIVE)
    engine.step()
    row_c = rows.row("state-c")
    assert row_c in (row_a, row_b)
    assert int(np.asarray(rows.state.counts[row_c]).sum()) == 0
    assert set(np.flatnonzero(np.asarray(rows.state.prompt_mask[row_c])).tolist()) == {8}
    while engine.has_unfinished_requests():
        engine.step()


def test_logprobs_modes():
    V = 50
    logits = np.linspace(-2, 3, V).astype(np.float32)[::-1].copy()
    p = smd.RowParams(temperature=2.0, top_k=4, seed=1)
    args = _one_row(V, p, logits)
    # raw_logprobs is the engine default, checked against transformers in tests/test_llm_api.py.
    outs = {mode: jax.jit(lambda l, m, s, mode=mode: sm.sample(l, m, s, max_logprobs=3, logprobs_mode=mode))(*args)
            for mode in ("raw_logits", "processed_logprobs")}
    tok = int(outs["raw_logits"].token_ids[0])
    assert tok < 4 and int(outs["processed_logprobs"].token_ids[0]) == tok
    assert np.allclose(outs["raw_logits"].top_logprobs[0], logits[:3])
    assert np.isclose(outs["raw_logits"].sampled_logprob[0], logits[tok])
    assert int(outs["raw_logits"].sampled_rank[0]) == tok + 1
    proc = jax.nn.log_softmax(logits[:4] / 2.0)          # temperature, then only the top 4 remain
    assert np.allclose(outs["processed_logprobs"].top_logprobs[0], proc[:3], atol=1e-6)
    assert np.isclose(outs["processed_logprobs"].sampled_logprob[0], proc[tok], atol=1e-6)

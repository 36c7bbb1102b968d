"""Async scheduling (``--async-scheduling``, the default) changes no output: token for token
the same as synchronous scheduling on the tiny Llama, for greedy and seeded sampling, penalties,
logprobs and prompt logprobs, n > 1, bad words, stop strings and max_tokens ending requests
at different steps, a JSON schema, preemption (a KV pool too small for the batch) and aborts
mid-stream; its steps really take the previous step's tokens on the device; nothing
compiles after warm-up (strict guard) and no KV block leaks."""

from __future__ import annotations

import json

import pytest

from support.batch_workload import workload
from support.engines import SMALL_ENGINE

from jaxllm import LLM, SamplingParams
from jaxllm.cli import build_parser, engine_config_from_args
from jaxllm.config import EngineConfig
from jaxllm.engine.core import _use_async
from jaxllm.runner import compile as cc
from jaxllm.sampling_params import StructuredOutputsParams as SO

# 9 usable blocks of 16 tokens: four running requests of the workload do not fit (preemption).
ENGINE = {**SMALL_ENGINE, "num_blocks_override": 10, "max_model_len": 128}


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """(synchronous, asynchronous) engines on the same model and settings: the second with
    the default, which is async scheduling; the first turned off by ``async_scheduling=False``."""
    return (LLM(tiny_llama, **ENGINE, async_scheduling=False), LLM(tiny_llama, **ENGINE))


@pytest.fixture(scope="module")
def fed_steps(engines):
    """Records, for the async engine, how many dispatched steps took a token on the device."""
    runner = engines[1].llm_engine.core.runner
    dispatch, seen = runner.dispatch, []

    def recording(so):
        h = dispatch(so)
        if h is not None:
            seen.append(h.step.feed is not None)
        return h

    runner.dispatch = recording
    yield seen
    runner.dispatch = dispatch


def _tokens(outs):
    """What must not change: tokens, finish reasons, text, logprobs and prompt logprobs."""
    return [(o.prompt_logprobs, [(c.token_ids, c.finish_reason, c.text, c.logprobs) for c in o.outputs]) for o in outs]


def _same(engines, fed_steps, prompts, params):
    sync, asy = engines
    before_fed = len(fed_steps)
    want = sync.generate(prompts, params, use_tqdm=False)
    compiles = cc.counts()
    got = asy.generate(prompts, params, use_tqdm=False)
    assert cc.counts() == compiles, "the async engine compiled after warm-up"
    assert _tokens(got) == _tokens(want)
    core = asy.llm_engine.core
    assert not core.has_unfinished_requests()
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks, "a KV block leaked"
    assert any(fed_steps[before_fed:]), "no step took the previous step's token on the device"
    return want


def test_engine_modes(engines):
    """Async scheduling is the default (LLM, serve); ``async_scheduling=False`` turns it off."""
    assert engines[1].llm_engine.core.async_scheduling
    assert not engines[0].llm_engine.core.async_scheduling


def test_cli_default_and_off_switch():
    """``jaxllm serve`` (every engine command) schedules asynchronously unless given
    ``--no-async-scheduling``."""
    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["serve"])).scheduler.async_scheduling
    assert engine_config_from_args(parser.parse_args(["serve", "--async-scheduling"])).scheduler.async_scheduling
    off = engine_config_from_args(parser.parse_args(["serve", "--no-async-scheduling"]))
    assert not off.scheduler.async_scheduling
    assert not _use_async(off)


def test_greedy_seeded_penalties_stops(engines, fed_steps):
    prompts, _ = workload(n=8, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=9, presence_penalty=1.5,
                             frequency_penalty=0.7, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=17, repetition_penalty=1.8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=15, repetition_penalty=1.3, presence_penalty=-1.0,
                             ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=25, stop=["e"], ignore_eos=True),
              SamplingParams(temperature=0.7, seed=2, max_tokens=6, ignore_eos=True, n=2),
              SamplingParams(temperature=1.0, max_tokens=3, seed=1, ignore_eos=True, logprobs=2, prompt_logprobs=1)]
    want = _same(engines, fed_steps, prompts, params)
    lengths = {len(c.token_ids) for o in want for c in o.outputs}
    assert len(lengths) > 3, "the requests did not end at different steps"


def test_bad_words(engines, fed_steps):
    prompts, _ = workload(n=4, seed=5)
    greedy = engines[0].generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                 use_tqdm=False)
    # Ban words greedy decoding picks: single-token ones (applied on the device) and a
    # multi-token one (read on the host: such a request's steps run synchronously).
    tok = engines[0].get_tokenizer()
    words = [tok.decode([t]).strip() for t in greedy[0].outputs[0].token_ids[:4]]
    words = [w for w in words if w] or ["the"]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, bad_words=words[:1]),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, bad_words=words),
              SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True,
                             bad_words=["Supercalifragilistic", *words]),
              SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)]
    _same(engines, fed_steps, prompts, params)


def test_json_schema(engines, fed_steps):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    prompts = ["A person:", "Free text:", "A person:"]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(json=person, disable_any_whitespace=True)),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=9, max_tokens=40,
                             structured_outputs=SO(json=person, disable_any_whitespace=True))]
    want = _same(engines, fed_steps, prompts, params)
    for o in (want[0], want[2]):
        if o.outputs[0].finish_reason == "stop":
            assert set(json.loads(o.outputs[0].text)) == {"name", "age"}


def test_preemption(engines, fed_steps):
    prompts, params = workload()
    before = engines[1].llm_engine.core.scheduler.num_preemptions
    _same(engines, fed_steps, prompts, params)
    assert engines[1].llm_engine.core.scheduler.num_preemptions > before, "the workload did not preempt"


def _stream_with_abort(llm, prompts, params, abort_id, abort_after):
    """Steps ``llm`` by hand, aborting ``abort_id`` once it has streamed ``abort_after`` tokens."""
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    final, aborted = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
            elif out.request_id == abort_id and not aborted and len(out.outputs[0].token_ids) >= abort_after:
                for f in engine.abort_request(abort_id):
                    final[f.request_id] = f.outputs[0].token_ids
                aborted = True
    assert aborted
    return final


def test_abort_mid_stream(engines, fed_steps):
    prompts, _ = workload(n=3, seed=8)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=6, max_tokens=30, ignore_eos=True, presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)]
    full = engines[0].generate(prompts, params, use_tqdm=False)
    got = _stream_with_abort(engines[1], prompts, params, "r1", 5)
    assert got["r0"] == full[0].outputs[0].token_ids
    assert got["r2"] == full[2].outputs[0].token_ids
    # The aborted request streamed a prefix of what it would have sampled.
    assert 5 <= len(got["r1"]) < 30 and got["r1"] == full[1].outputs[0].token_ids[:len(got["r1"])]
    core = engines[1].llm_engine.core
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def test_speculation_keeps_synchronous_scheduling(tiny_llama):
    """Speculative decoding proposes from the sampled tokens on the host, and a multi-host
    engine publishes each step before it runs: with the default (async on) or asked for,
    both fall back to synchronous scheduling without an error (speculation's own identity
    tests: tests/spec_decode/)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    for asked in ({}, {"async_scheduling": True}):
        assert not _use_async(EngineConfig.from_kwargs(model=tiny_llama, speculative_config=spec, **asked))
        assert not _use_async(EngineConfig.from_kwargs(model=tiny_llama, num_hosts=2, host_index=0, **asked))
        assert _use_async(EngineConfig.from_kwargs(model=tiny_llama, **asked))

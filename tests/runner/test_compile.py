"""AOT compilation: zero traces and compiles after warm-up, a guard that catches them, and
a second process that finds every step in the persistent cache."""

from __future__ import annotations

import json
import os
import subprocess

import jax
import jax.numpy as jnp
import pytest

from jaxllm import SamplingParams
from jaxllm.errors import CompileGuardError
from jaxllm.runner import compile as cc
from support.probes import probe_command, probe_env


def test_no_trace_or_compile_after_warmup_across_buckets(tiny_llm):
    runner = tiny_llm.llm_engine.core.runner
    visited = set()
    run = runner._run

    def recording_run(step):
        visited.add(step.bucket)
        return run(step)

    runner._run = recording_run
    try:
        before = cc.counts()
        prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (1, 3, 7, 30, 45, 60)]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 9, 2, 12, 5, 7)]
        params[1] = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=9, logprobs=3)
        tiny_llm.generate(prompts, params, use_tqdm=False)
        after = cc.counts()
    finally:
        runner._run = run
    assert len(visited) >= 4, visited
    assert after["traces"] == before["traces"], "a step traced after warm-up"
    assert after["compiles"] == before["compiles"], "a step compiled after warm-up"


def test_guard_fails_a_step_that_compiles(tiny_llm):
    runner = tiny_llm.llm_engine.core.runner
    run = runner._run

    def leaky_run(step):
        jax.jit(lambda x: x * 3)(jnp.ones(7))   # a new program inside the step
        return run(step)

    runner._run = leaky_run
    try:
        with pytest.raises((CompileGuardError, RuntimeError)):
            tiny_llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        runner._run = run
    # The engine is still usable afterwards.
    out = tiny_llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_second_start_with_default_sizing_compiles_nothing(tiny_checkpoints, tmp_path):
    """Two processes, the same model and flags, default KV sizing, different free memory (as
    two starts of a server see): the second loads every program and compiles none.  Then, in
    that second process, an engine started without the saved programs finds every one in JAX's
    persistent cache (the first process's compiles)."""
    cache = str(tmp_path / "xla")

    def probe(model, *free):
        r = subprocess.run(probe_command("warmup_probe", model, cache, *free), capture_output=True, text=True,
                           timeout=600, env=probe_env())
        assert r.returncode == 0, r.stderr[-2000:]
        return [json.loads(line) for line in r.stdout.strip().splitlines()[-len(free):]]

    llama = tiny_checkpoints["llama_gqa_untied"]
    [first] = probe(llama, 3 * 2**20)
    second, third = probe(llama, 2 * 2**20, 5 * 2**20)
    assert first["compiled"] == first["programs"] and first["delta"]["cache_misses"] >= first["programs"]
    assert second["num_blocks"] == first["num_blocks"], "the KV pool followed free memory"
    assert second["loaded"] == second["programs"] and second["compiled"] == 0, second
    # (XLA reports a persistent-cache hit as a compile event too: a miss is a real compile.)
    assert second["delta"]["cache_misses"] == 0, second
    assert second["tokens"] == first["tokens"]
    # Without the saved programs, JAX's persistent cache alone still compiles none (and what
    # it loads is not saved: program_cache.ProgramCache.compile).
    assert third["loaded"] == 0 and third["compiled"] == third["programs"], third
    assert third["delta"]["cache_misses"] == 0 and third["delta"]["cache_hits"] >= third["programs"], third
    assert third["tokens"] == first["tokens"]


def test_one_shot_engine_compiles_only_what_it_runs_and_a_server_compiles_the_rest(tiny_llama, tiny_llm):
    """precompile="auto" (the offline default): nothing but the sampler-row writers before the
    first step; a step compiles its bucket and the decode bucket that follows, once.  After
    that the guard holds for those buckets, and an AsyncEngine (the server) compiles every
    other bucket before it takes a request."""
    from support.engines import SMALL_ENGINE

    from jaxllm import LLM
    from jaxllm.engine.async_engine import AsyncEngine
    llm = LLM(tiny_llama, **{**SMALL_ENGINE, "precompile": "auto"})
    runner = llm.llm_engine.core.runner
    assert runner.compiler.steps == {} and runner.compiler.samplers == {}
    prompt = [{"prompt_token_ids": list(range(100, 106))}]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    first = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert set(runner.compiler.steps) == {(8, 4), (1, 1)}, runner.compiler.steps.keys()
    assert set(runner.compiler.samplers) == {4, 1}
    assert first == tiny_llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    before = cc.counts()
    assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == first
    after = cc.counts()
    assert after["traces"] == before["traces"] and after["compiles"] == before["compiles"]
    # The strict guard still fails a step of a compiled bucket that compiles.
    run = runner._run

    def leaky_run(step):
        jax.jit(lambda x: x * 5)(jnp.ones(9))
        return run(step)

    runner._run = leaky_run
    try:
        with pytest.raises((CompileGuardError, RuntimeError)):
            llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        runner._run = run
    assert not runner.all_compiled
    engine = AsyncEngine(llm.llm_engine)
    try:
        assert runner.all_compiled
        assert set(runner.compiler.steps) == set(runner.buckets)
    finally:
        engine.shutdown()


def test_on_demand_is_refused_for_a_server(tiny_llama):
    from support.engines import SMALL_ENGINE

    from jaxllm import LLM
    from jaxllm.engine.async_engine import AsyncEngine
    llm = LLM(tiny_llama, **{**SMALL_ENGINE, "precompile": "on-demand"})
    with pytest.raises(ValueError, match="--precompile on-demand is for one-shot commands"):
        AsyncEngine(llm.llm_engine)
    with pytest.raises(ValueError, match="--precompile must be one of auto, all, on-demand"):
        LLM(tiny_llama, **{**SMALL_ENGINE, "precompile": "lazy"})

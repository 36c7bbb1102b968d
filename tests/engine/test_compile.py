"""AOT compilation: zero traces and compiles after warm-up, a guard that catches them, and
a second process that finds every step in the persistent cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxllm import SamplingParams
from jaxllm.errors import CompileGuardError
from jaxllm.runner import compile as cc

HERE = os.path.dirname(os.path.abspath(__file__))


def test_no_trace_or_compile_after_warmup_across_buckets(tiny_llm):
    runner = tiny_llm.llm_engine.core.runner
    visited = set()
    prepare = runner._prepare

    def recording_prepare(so):
        out = prepare(so)
        visited.add(out[3])
        return out

    runner._prepare = recording_prepare
    try:
        before = cc.counts()
        prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (1, 3, 7, 30, 45, 60)]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 9, 2, 12, 5, 7)]
        params[1] = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=9, logprobs=3)
        tiny_llm.generate(prompts, params, use_tqdm=False)
        after = cc.counts()
    finally:
        runner._prepare = prepare
    assert len(visited) >= 4, visited
    assert after["traces"] == before["traces"], "a step traced after warm-up"
    assert after["compiles"] == before["compiles"], "a step compiled after warm-up"


def test_guard_fails_a_step_that_compiles(tiny_llm):
    runner = tiny_llm.llm_engine.core.runner
    run = runner._run

    def leaky_run(bucket, inputs):
        jax.jit(lambda x: x * 3)(jnp.ones(7))   # a new program inside the step
        return run(bucket, inputs)

    runner._run = leaky_run
    try:
        with pytest.raises((CompileGuardError, RuntimeError)):
            tiny_llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        runner._run = run
    # The engine is still usable afterwards.
    out = tiny_llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_second_process_hits_the_persistent_cache(tiny_checkpoints, tmp_path):
    cache = str(tmp_path / "xla")

    def probe(model):
        r = subprocess.run([sys.executable, os.path.join(HERE, "warmup_probe.py"), model, cache],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    llama = tiny_checkpoints["llama_gqa_untied"]
    first, second = probe(llama), probe(llama)
    assert first["delta"]["cache_misses"] >= first["buckets"] + first["samplers"]
    assert second["delta"]["cache_misses"] == 0, second
    assert second["delta"]["cache_hits"] == first["delta"]["cache_misses"]
    assert second["tokens"] == first["tokens"]
    # Another model with the same vocabulary and cache shape compiles only its own steps: the
    # samplers (one per sequence bucket, independent of the model), the state-row writers
    # and the cache allocation are the first model's programs, found in the cache.
    other = probe(tiny_checkpoints["qwen2_qkv_bias"])
    assert other["samplers"] == 3, other                 # S = 1, 2, 4 under max_num_seqs=4
    assert other["delta"]["cache_misses"] == other["buckets"], other
    assert other["delta"]["cache_hits"] >= other["samplers"] + 2, other

"""Automatic prefix caching end to end: the same tokens with the cache on and off (greedy,
and with a repetition penalty over a cached prompt), the cached token counts, the hit rate
of a shared-prefix workload, and preemption from a pool too small for the load.

The "off" runs switch the engine's prefix cache off (the pure-Python flag that
``enable_prefix_caching=False`` sets), so no second engine has to be compiled.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from support.engines import SMALL_ENGINE

from jaxllm import LLM, SamplingParams

BS = 16  # SMALL_ENGINE's block size (the default)


@contextlib.contextmanager
def caching_off(llm):
    kv = llm.llm_engine.core.kv_manager
    was = kv.enable_prefix_caching
    kv.enable_prefix_caching = False
    try:
        yield
    finally:
        kv.enable_prefix_caching = was


def toks(rng, n):
    return rng.integers(3, 5000, size=n).tolist()


def run(llm, prompts, params, salt=None):
    salted = {"cache_salt": salt} if salt else {}
    outs = llm.generate([{"prompt_token_ids": p, **salted} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def shared_prefix_case(seed):
    """A warm-up prompt, then prompts sharing 16, 21, 32 (a block boundary) and all of the
    warm prompt's leading tokens, and whole prompts seen before; with the cached tokens each
    must report (full blocks only, never the whole prompt)."""
    rng = np.random.default_rng(seed)
    base = toks(rng, 40)
    warm = base + toks(rng, 10)
    t = [toks(rng, 10) for _ in range(3)]
    prompts = [base[:16] + t[0],      # exactly one block shared
               base[:32] + t[1],      # shared up to a block boundary
               base[:21] + t[2],      # shared into the middle of the second block
               base,                  # a prefix of the warm prompt: 2 of its 2.5 blocks
               base[:32],             # block aligned and wholly cached: its last block is recomputed
               warm]                  # the very same prompt again
    expected_cached = [16, 32, 16, 32, 16, 48]
    return warm, prompts, expected_cached


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_outputs_equal_with_prefix_caching_on_and_off(tiny_llm):
    # The engine is shared by the session's tests: a salt of this test's own keeps blocks other
    # tests cached (the same random tokens) out of its counts (a suite run saw 16 extra hits).
    warm, prompts, expected_cached = shared_prefix_case(seed=1)
    salt = "test_outputs_equal_with_prefix_caching_on_and_off"
    stats0 = tiny_llm.llm_engine.get_stats()
    _, warm_cached = run(tiny_llm, [warm], GREEDY, salt)
    on, cached = run(tiny_llm, prompts, GREEDY, salt)
    stats1 = tiny_llm.llm_engine.get_stats()
    with caching_off(tiny_llm):
        warm_off, _ = run(tiny_llm, [warm], GREEDY)
        off, cached_off = run(tiny_llm, prompts, GREEDY)
    assert cached == expected_cached
    assert cached_off == [0] * len(prompts)
    assert on == off
    assert on[-1] == warm_off[0]
    assert warm_cached == [0]
    assert stats1.prefix_cache_hits - stats0.prefix_cache_hits == sum(expected_cached)
    assert stats1.prefix_cache_queries - stats0.prefix_cache_queries == len(warm) + sum(map(len, prompts))


def test_repetition_penalty_counts_the_cached_prompt(tiny_llm):
    # A logit bias makes twelve tokens the only candidates; eight of them occur only in the
    # cached part of the prompts.  The penalty must see them there (the prompt mask of the
    # cached tokens is written before the first step), so the first token is one of the
    # other four, and every output equals the run that computed the whole prompt.
    rng = np.random.default_rng(2)
    T = rng.choice(np.arange(5000, 9000), size=12, replace=False).tolist()
    seen, unseen = T[:8], T[8:]
    shared = (seen * 6)[:40] + toks(rng, 8)                 # 48 tokens: three full blocks
    prompts = [shared + toks(rng, 3), shared[:40] + toks(rng, 6), shared + toks(rng, 1)]
    bias = {t: 12.0 for t in T}
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=rp, logit_bias=bias)
              for rp in (3.0, 2.5, 4.0)]
    run(tiny_llm, [shared + [7]], GREEDY)                    # caches the shared blocks
    on, cached = run(tiny_llm, prompts, params)
    with caching_off(tiny_llm):
        off, _ = run(tiny_llm, prompts, params)
    assert cached == [48, 32, 48]
    assert all(o[0] in unseen for o in off), "precondition: the penalty decides the first token"
    assert on == off


def test_shared_prefix_workload_hit_rate(tiny_llm):
    rng = np.random.default_rng(3)
    shared = toks(rng, 64)
    prompts = [shared + toks(rng, 8) for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    before = tiny_llm.llm_engine.get_stats()
    on, cached = run(tiny_llm, prompts, params)
    after = tiny_llm.llm_engine.get_stats()
    hit_rate = sum(cached) / (len(shared) * len(prompts))
    assert hit_rate > 0.9, (hit_rate, cached)
    assert after.prefix_cache_hits - before.prefix_cache_hits == sum(cached)
    with caching_off(tiny_llm):
        off, _ = run(tiny_llm, prompts, params)
    assert on == off


@pytest.fixture(scope="module")
def small_pool_llm(tiny_llama):
    # 9 usable blocks of 16 tokens (one 128-token sequence fits): four running requests do not.
    return LLM(tiny_llama, **{**SMALL_ENGINE, "num_blocks_override": 10, "max_model_len": 128})


def test_preemption_with_prefix_caching_keeps_outputs_equal(tiny_llm, small_pool_llm):
    rng = np.random.default_rng(4)
    base = [toks(rng, 40) for _ in range(2)]
    prompts = [base[i % 2][:16 * (1 + i % 3)] + toks(rng, int(rng.integers(1, 20))) for i in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(10, 40, 12)]
    with caching_off(tiny_llm):
        solo = [run(tiny_llm, [p], sp)[0][0] for p, sp in zip(prompts, params)]
    core = small_pool_llm.llm_engine.core
    assert core.kv_manager.enable_prefix_caching
    out, cached = run(small_pool_llm, prompts, params)
    assert core.scheduler.num_preemptions > 0, "precondition: the small pool preempts"
    assert sum(cached) > 0, "precondition: the cache served some prompts"
    assert out == solo
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def test_cache_salt_in_offline_prompts(tiny_llm):
    rng = np.random.default_rng(5)
    p = toks(rng, 40)
    one = SamplingParams(temperature=0, max_tokens=1)

    def cached(**extra):
        return tiny_llm.generate([{"prompt_token_ids": p, **extra}], one, use_tqdm=False)[0].num_cached_tokens

    assert [cached(), cached(), cached(cache_salt="a"), cached(cache_salt="b"), cached(cache_salt="a")] == \
        [0, 32, 0, 0, 32]
    with pytest.raises(ValueError, match="cache_salt"):
        cached(cache_salt="")

"""The speculation identity tests' shared workload (tests/spec_decode/test_spec_identity.py and
test_spec_identity_draft.py): 18 requests under every kind of sampling parameter, plain
decoding's outputs of it on the session's ``tiny_llm`` (a module fixture), readers of an
engine's speculation counters, and a KV pool shrunk for a preemption test."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from jaxllm import SamplingParams


def repetitive(rng, period, reps):
    unit = rng.integers(3, 5000, size=period).tolist()
    return unit * reps


def workload(seed=0):
    """18 requests: repetitive prompts (ngram proposes from them) and random ones (it rarely
    does), under every kind of sampling parameter: greedy; temperature with top-k / top-p,
    min-p, logit bias and allowed tokens; the three penalties; min_tokens; logprobs."""
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    kinds = [
        dict(temperature=0),
        dict(temperature=0.8, top_p=0.9, top_k=20, seed=11),
        dict(temperature=0.8, seed=5, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3),
        dict(temperature=0, min_tokens=6, logprobs=2),
        dict(temperature=0.7, seed=13, min_p=0.05, logit_bias={100: 5.0, 2000: -100.0}),
        dict(temperature=0.9, seed=17, allowed_token_ids=list(range(3, 400))),
    ]
    for i in range(18):
        toks = repetitive(rng, int(rng.integers(2, 7)), int(rng.integers(3, 8))) if i % 4 != 3 else \
            rng.integers(3, 5000, size=int(rng.integers(4, 40))).tolist()
        prompts.append({"prompt_token_ids": toks})
        params.append(SamplingParams(max_tokens=int(rng.integers(8, 40)), ignore_eos=True, **kinds[i % len(kinds)]))
    return prompts, params


@pytest.fixture(scope="module")
def plain_outputs(tiny_llm):
    prompts, params = workload()
    return tiny_llm.generate(prompts, params, use_tqdm=False)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def spec_stats(llm):
    return llm.llm_engine.core.scheduler.spec_stats


def snapshot(llm):
    s = spec_stats(llm)
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


@contextlib.contextmanager
def small_pool(llm, num_free):
    """Holds all but ``num_free`` of ``llm``'s free KV blocks out of its pool while active: a
    pool too small for a batch on the engine's own compiled programs (an engine built with a
    smaller ``num_blocks_override`` has other KV shapes, so a whole new set of programs)."""
    pool = llm.llm_engine.core.kv_manager.pool
    held = pool.allocate(pool.num_free_blocks - num_free)
    try:
        yield
    finally:
        pool.release(held)

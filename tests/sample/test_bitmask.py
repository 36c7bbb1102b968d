"""The grammar bitmask in the compiled sampler: forbidden tokens are never drawn, processed
logprobs see the mask and raw ones do not, and an all-ones row changes nothing."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxllm.sample import metadata as smd
from jaxllm.sample import sampler as sm
from jaxllm.sample.bitmask import mask_words
from support.sampler_harness import one_row as _one_row


def bitmask(V: int, allowed) -> np.ndarray:
    m = np.zeros((1, mask_words(V)), np.uint32)
    for t in allowed:
        m[0, t // 32] |= np.uint32(1 << (t % 32))
    return m


@functools.cache
def sampler(mode: str):
    """One jitted sampler per logprobs mode, shared by the tests (a compile each)."""
    return jax.jit(lambda l, m, s, a: sm.sample(l, m, s, a, max_logprobs=3, logprobs_mode=mode))


def test_mask_applies_before_the_draw_and_processed_logprobs():
    V = 70                                                  # two words, the second one partial
    logits = np.linspace(-2, 3, V).astype(np.float32)[::-1].copy()   # token 0 is the best
    allowed = [7, 40, 66]
    args = _one_row(V, smd.RowParams(temperature=0.0), logits)
    run = {mode: sampler(mode) for mode in ("raw_logits", "processed_logprobs")}
    raw = run["raw_logits"](*args, bitmask(V, allowed))
    proc = run["processed_logprobs"](*args, bitmask(V, allowed))
    assert int(raw.token_ids[0]) == int(proc.token_ids[0]) == 7
    assert np.allclose(raw.top_logprobs[0], logits[:3])      # raw: before the mask
    want = jax.nn.log_softmax(logits[allowed])
    assert np.allclose(proc.top_logprobs[0], want, atol=1e-6)
    assert np.asarray(proc.top_ids[0]).tolist() == allowed
    ones = np.full((1, mask_words(V)), 0xFFFFFFFF, np.uint32)
    free = run["processed_logprobs"](*args, ones)
    assert int(free.token_ids[0]) == 0


def test_random_rows_draw_only_allowed_tokens():
    V = 70
    logits = np.zeros(V, np.float32)
    allowed = [3, 35, 69]
    draw = sampler("processed_logprobs")
    seen = set()
    for seed in range(40):
        args = _one_row(V, smd.RowParams(temperature=1.0, seed=seed), logits)
        seen.add(int(draw(*args, bitmask(V, allowed)).token_ids[0]))
    assert seen == set(allowed)

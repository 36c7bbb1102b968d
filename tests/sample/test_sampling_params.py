"""Every sampling parameter does what vLLM documents, end to end through ``LLM.generate`` on
the tiny Llama (each test fails if its parameter is ignored), plus seeded determinism across
batch compositions and preemption, and the validation errors (each names its parameter)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from support.tiny_models import load_hf

from jaxllm import LLM, SamplingParams
from jaxllm.engine.processor import InputProcessor

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPT = "The quick brown fox"


def gen(llm, prompt, sp):
    return llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]


@pytest.fixture(scope="module")
def repeating(tiny_llm):
    """A prompt whose greedy continuation repeats a token: (prompt ids, output, index of the repeat)."""
    for text in (PROMPT, "Hello world", "Once upon a time", "a b a b a b", "1 2 3 4"):
        ids = tiny_llm.get_tokenizer().encode(text)
        out = gen(tiny_llm, {"prompt_token_ids": ids}, GREEDY).token_ids
        for d, t in enumerate(out):
            if t in out[:d]:
                return ids, out, d
    pytest.fail("no greedy continuation of the tiny model repeats a token")


def first_divergence(a, b):
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.5), dict(presence_penalty=2.0),
                                dict(frequency_penalty=2.0)], ids=lambda kw: next(iter(kw)))
def test_penalties_change_a_repeating_greedy_continuation(tiny_llm, repeating, kw):
    ids, base, d = repeating
    out = gen(tiny_llm, {"prompt_token_ids": ids}, GREEDY.replace(**kw)).token_ids
    assert out != base
    j = first_divergence(out, base)
    assert j <= d
    # Only a token that already occurred can have been pushed down (in the output, or for the
    # repetition penalty also in the prompt).
    seen = base[:j] + (ids if "repetition_penalty" in kw else [])
    assert base[j] in seen


def test_repetition_penalty_counts_prompt_tokens_presence_does_not(tiny_llm, repeating):
    ids, base, d = repeating
    prompt = {"prompt_token_ids": ids + base[:d]}     # the repeated token now occurs in the prompt
    one = GREEDY.replace(max_tokens=1)
    assert gen(tiny_llm, prompt, one).token_ids == [base[d]]
    assert gen(tiny_llm, prompt, one.replace(repetition_penalty=1.5)).token_ids != [base[d]]
    assert gen(tiny_llm, prompt, one.replace(presence_penalty=2.0, frequency_penalty=2.0)).token_ids == [base[d]]


def test_logit_bias_forces_and_forbids(tiny_llm):
    forced = gen(tiny_llm, PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True,
                                                  logit_bias={4242: 100.0}))
    assert forced.token_ids == [4242] * 8
    base = gen(tiny_llm, PROMPT, GREEDY).token_ids
    banned = gen(tiny_llm, PROMPT, GREEDY.replace(logit_bias={base[0]: -100.0})).token_ids
    assert banned[0] != base[0]


def test_min_tokens_suppresses_eos(tiny_llm):
    eos = tiny_llm.llm_engine.eos_token_ids[0]
    sp = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0})
    assert gen(tiny_llm, PROMPT, sp).token_ids == [eos]
    out = gen(tiny_llm, PROMPT, sp.replace(min_tokens=4))
    assert len(out.token_ids) == 5 and eos not in out.token_ids[:4] and out.token_ids[4] == eos
    assert out.finish_reason == "stop"


def test_min_tokens_suppresses_stop_token_ids_which_then_stop(tiny_llm):
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={777: 100.0},
                        stop_token_ids=[777])
    assert gen(tiny_llm, PROMPT, sp).token_ids == [777]
    out = gen(tiny_llm, PROMPT, sp.replace(min_tokens=3))
    assert len(out.token_ids) == 4 and out.token_ids[3] == 777 and 777 not in out.token_ids[:3]
    assert out.finish_reason == "stop" and out.stop_reason == 777


def test_allowed_token_ids(tiny_llm):
    allowed = [5, 17, 300, 4000, 12345]
    out = gen(tiny_llm, PROMPT, SamplingParams(temperature=1.5, seed=4, max_tokens=20, ignore_eos=True,
                                               allowed_token_ids=allowed)).token_ids
    assert set(out) <= set(allowed) and len(set(out)) >= 2


def _contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_bad_words_single_and_multi_token(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    proc = tiny_llm.llm_engine.input_processor
    base = gen(tiny_llm, PROMPT, GREEDY).token_ids
    found = {}
    for i in range(len(base) - 1):
        for n in (1, 2):
            word = tok.decode(base[i:i + n])
            if not word.strip() or n in found:
                continue
            seqs = proc.resolve(GREEDY.replace(bad_words=[word])).bad_words_token_ids
            if any(len(s) == n and _contains(base, s) for s in seqs):
                found[n] = (word, seqs)
    assert set(found) == {1, 2}, found
    for n, (word, seqs) in found.items():
        out = gen(tiny_llm, PROMPT, GREEDY.replace(bad_words=[word])).token_ids
        assert out != base
        assert not any(_contains(out, s) for s in seqs), (word, seqs, out)


def test_prompt_logprobs_match_transformers(tiny_llm, tiny_llama):
    prompt = list(range(21, 71))      # 50 tokens: prefilled in two chunks (32-token budget)
    res = tiny_llm.generate([{"prompt_token_ids": prompt}],
                            SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    plp = res.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    with torch.no_grad():
        logits = load_hf(tiny_llama)(torch.tensor([prompt])).logits[0].double()
    ref = torch.log_softmax(logits, -1).numpy()
    for i in range(1, len(prompt)):
        row, tok, entry = ref[i - 1], prompt[i], plp[i]
        assert tok in entry and len(entry) >= 3
        assert abs(entry[tok].logprob - row[tok]) < 1e-4
        # the rank among the reference's logprobs, up to the tokens within float32 rounding of
        # this one (its logprob, near -12, has an ulp of 1e-6 and is within 1e-5 of the float64 one)
        assert 1 + int((row > row[tok] + 1e-5).sum()) <= entry[tok].rank <= 1 + int((row > row[tok] - 1e-5).sum())
        assert set(np.argsort(-row)[:3].tolist()) <= set(entry)
    none = tiny_llm.generate([{"prompt_token_ids": prompt}], GREEDY.replace(max_tokens=1), use_tqdm=False)[0]
    assert none.prompt_logprobs is None


MIX = [
    SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=77, max_tokens=20, ignore_eos=True,
                   presence_penalty=0.3, repetition_penalty=1.1),
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, frequency_penalty=0.5),
    SamplingParams(temperature=1.2, min_p=0.05, seed=5, max_tokens=15, ignore_eos=True, logit_bias={10: 3.0}),
    SamplingParams(temperature=0.7, seed=6, max_tokens=25, ignore_eos=True, bad_words=["the"]),
    SamplingParams(temperature=1.0, seed=8, max_tokens=12, ignore_eos=True, allowed_token_ids=list(range(100, 400))),
]


def _mix_prompts():
    rng = np.random.default_rng(1)
    return [{"prompt_token_ids": rng.integers(3, 5000, size=int(n)).tolist()} for n in (5, 41, 2, 17, 60)]


def test_seeded_requests_are_the_same_alone_and_among_others(tiny_llm):
    prompts = _mix_prompts()
    alone = [tiny_llm.generate([p], sp, use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts, MIX)]
    together = tiny_llm.generate(prompts, MIX, use_tqdm=False)
    reordered = tiny_llm.generate(prompts[::-1], MIX[::-1], use_tqdm=False)[::-1]
    for a, b, c in zip(alone, together, reordered):
        assert a.token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        assert a.text == b.outputs[0].text
    # The seed matters (the draw is not accidentally greedy).
    other = tiny_llm.generate([prompts[0]], MIX[0].replace(seed=78), use_tqdm=False)[0].outputs[0]
    assert other.token_ids != alone[0].token_ids


def test_penalty_state_survives_preemption(tiny_llm):
    """Preempted requests are recomputed from prompt + outputs: their penalty counts must be
    rebuilt too (the state row is reset and every recomputed token counted again)."""
    prompts = _mix_prompts() * 2
    params = [sp.replace(max_tokens=30) for sp in MIX] * 2
    expect = [tiny_llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    # The shared engine's configuration with a pool too small for four running requests (the
    # same as tests/engine/test_batching.py's, so its compiled steps come from the cache).
    cfg = tiny_llm.llm_engine.config
    cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, num_blocks_override=10),
                              scheduler=dataclasses.replace(cfg.scheduler, max_model_len=128))
    llm = LLM.from_engine_config(cfg)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    assert got == expect


def test_validation_errors_name_the_parameter():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: float("inf")})
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(n=2, temperature=0)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    proc = InputProcessor(None, vocab_size=100, max_model_len=64, eos_token_ids=(2,), max_logprobs=5)
    for sp, name in [(SamplingParams(logit_bias={100: 1.0}), "logit_bias"),
                     (SamplingParams(allowed_token_ids=[1, 100]), "allowed_token_ids"),
                     (SamplingParams(prompt_logprobs=6), "prompt_logprobs"),
                     (SamplingParams(logprobs=6), "logprobs"),
                     (SamplingParams(stop_token_ids=[100]), "stop_token_ids"),
                     (SamplingParams(bad_words=["x"]), "bad_words")]:
        with pytest.raises(ValueError, match=name):
            proc.check_params(sp)
    proc.check_params(SamplingParams(min_tokens=1, stop_token_ids=list(range(90))))   # fits the 128-wide list
    big = InputProcessor(None, vocab_size=1000, max_model_len=64, eos_token_ids=(2,), max_logprobs=5)
    with pytest.raises(ValueError, match="stop_token_ids"):
        big.check_params(SamplingParams(min_tokens=1, stop_token_ids=list(range(200, 400))))
    big.check_params(SamplingParams(stop_token_ids=list(range(200, 400))))   # no min_tokens: no limit

"""The built-in model on ``--cpu-matmul native-int8`` on a CPU with AVX-512 VNNI (the default
until int8's perplexity cost was measured: docs/BENCHMARKS.md, "Perplexity"): its Q4_1 and Q8_0
blocks, in groups of 16 interleaved rows, meet activations rounded to int8 per 32 values
(``cpu/quant_dot.cc``'s ``jaxllm_dot16_*``; without VNNI, the row-major AVX2 tiles and Q4_1's
one-row walk: every test but the interleaved kernel's runs on both), which is llama.cpp's arithmetic
(``vec_dot_q4_1_q8_1``) and vLLM's GGUF kernels' (``ggml_mul_mat_vec_a8``).

The kernel is exact against an emulation of that arithmetic (tests/kernels/test_cpu_quant_dot.py);
what the rounding does to the model is measured here against the float32 engines: a rounded
activation moves by up to 1/254 of its block's largest value, and SmolLM2's activations have
large outliers, so across 30 layers the logits move by a few units (measured: 3.5 of logits
up to 31 on random token ids, where the distributions are flat) and greedy decoding parts
from the float engines after some tokens (measured 3-30 of 32, as llama.cpp parts from them:
docs/BENCHMARKS.md).  ``--cpu-matmul native`` keeps float32 activations (auto: those, or int16
ones for Q4_1 where the CPU lacks AVX-512: tests/quant/test_int16_activations.py).

Rounding also turns a last-bit difference into a whole step of the int8 grid, so speculative
decoding's promise (plain decoding's exact tokens) needs a token's logits to be the same
bits in a decode step and in a verification step of another shape: checked here, and with
speculation on against off.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.cpu import native
from jaxllm.quant import PackedWeight

from support.engines import BUILTIN_ENGINE
from support.builtin_prompts import PROMPTS
from support.tiny_models import paged_logits

pytestmark = pytest.mark.skipif(not native.quant_available(), reason="the native packed-block matmul did not build")
vnni = pytest.mark.skipif(not native.quant_dot_vnni(),
                          reason="the CPU lacks AVX512F/BW/VNNI: native-int8 runs the row-major AVX2 tiles, "
                                 "not the interleaved kernel this test checks for")


# One engine on --cpu-matmul native-int8 and one load of the model for the module's tests:
# the built-in model's 30 layers make each a few seconds.


@pytest.fixture(scope="module")
def int8_llm():
    """The built-in model's engine with int8 activations (``--cpu-matmul native-int8``)."""
    return LLM(**BUILTIN_ENGINE, cpu_matmul="native-int8")


@pytest.fixture(scope="module")
def builtin_model():
    """The built-in model as loaded (packed Q4_1/Q8_0 blocks)."""
    from jaxllm.models.loader import load_model
    return load_model(None)


# Every prompt position of IDS through the paged forward, in steps of 8 tokens (EIGHT) or of 1
# and 8 tokens (ONE): two programs per matmul, shared by the step-shape test and the int8
# error test.  Positions 8-15 are computed one token per step in ONE, eight per step in
# EIGHT (XLA's norm sums some rows of an 8-row step in another order than a 1-row step's; of
# a 5-row step in the same one).
IDS = [1] + list(range(300, 340))                    # 41 tokens
EIGHT = tuple(range(8, 41, 8))                       # 8 x 5, then 1
ONE = (*range(8, 16), *EIGHT[1:])                    # 8, 1 x 8, 8 x 4, then 1


@pytest.fixture(scope="module")
def step_logits(builtin_model):
    """(matmul, split) -> the built-in model's logits [41, vocab] (native attention),
    each computed once for the module."""
    memo = {}

    def get(matmul, split):
        if (matmul, split) not in memo:
            memo[matmul, split] = paged_logits(builtin_model, IDS, scan_layers=False, split=split, matmul=matmul,
                                               attention="native")
        return memo[matmul, split]
    return get


@pytest.mark.slow
@vnni
def test_int8_engine_runs_the_interleaved_int8_kernel(builtin_llm, int8_llm):
    llm = int8_llm
    runner = llm.llm_engine.core.runner
    assert runner.cfg.kernels.int8_activations
    packed = [w for w in jax.tree.leaves(runner.params, is_leaf=lambda w: isinstance(w, PackedWeight))
              if isinstance(w, PackedWeight)]
    # every matrix, the tied Q8_0 embedding (the LM head, gathered by rows too) included
    assert {(w.type_name, w.interleaved) for w in packed} == {("Q4_1", 16), ("Q8_0", 16)}
    assert runner.weight_bytes() < 100 * 2**20     # the file's bytes: interleaving adds none

    # Four prompts (max_num_seqs): prefilled in one step, decoded together, ending together: the
    # engine compiles the (32, 4) and (4, 4) buckets only.
    prompts = PROMPTS[:4]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    got = llm.generate(prompts, params, use_tqdm=False)
    ref = builtin_llm.generate(prompts, params, use_tqdm=False)   # float32 activations
    agree = []
    for prompt, g, r in zip(prompts, got, ref):
        gt, rt = g.outputs[0].token_ids, r.outputs[0].token_ids
        n = next((i for i, (a, b) in enumerate(zip(gt, rt)) if a != b), len(rt))
        agree.append(n)
        if n < len(rt):
            top2 = sorted((lp.logprob for lp in r.outputs[0].logprobs[n].values()), reverse=True)[:2]
            print(f"{prompt!r}: int8 parts from float32 at token {n} of 32, float32's top-2 margin "
                  f"{top2[0] - top2[1]:.3f}")
    print(f"int8 vs float32 activations, tokens equal before the first difference: {agree}; buckets compiled: "
          f"{sorted(runner.compiler.steps)}")
    # The rounding moves logits by a few tenths of a nat at most tokens: the first tokens agree.
    assert min(agree) >= 2 and np.mean(agree) >= 8, agree


@pytest.mark.slow
def test_int8_logits_error_against_the_dequantized_model(step_logits):
    """int8 activations' logits (the EIGHT step shapes of the test below: no program of its own)
    against the dequantized float32 model's: the reference is tests/quant/test_builtin_packed.py's
    ``test_packed_logits_error`` program (same ids, split and backends: a compile-cache hit in
    the suite)."""
    from jaxllm.models.loader import load_model
    got = step_logits("native-int8", EIGHT)
    ref = paged_logits(load_model(None, dequantize=True), IDS, scan_layers=False, split=24)
    err = np.abs(got - ref).max()
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    print(f"built-in model, int8 activations vs dequantized float32: max |logit error| {err:.2f} "
          f"(logits up to {np.abs(ref).max():.1f}), argmax equal at {agree:.0%} of {len(IDS)} positions")
    assert err < 0.2 * np.abs(ref).max()
    assert agree > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("matmul", ["native-int8", "native"])
def test_a_tokens_logits_do_not_depend_on_the_step_shape(step_logits, matmul):
    """The same positions computed one token per step and eight per step give bit-identical
    logits on the native CPU path (and so do the later positions, on those caches), on every
    CPU the kernels run on: without VNNI, native-int8's one-token steps take Q4_1's one-row
    walk and its eight-token steps the row tiles (cpu/quant_dot.cc).  XLA's
    own norms did not: it sums a row's squares in an order that depends on the step's shape
    (cpu/norm.cc), which with int8 activations moved the logits by up to 1.7 after 30 layers."""
    one, eight = step_logits(matmul, ONE), step_logits(matmul, EIGHT)
    rows = np.nonzero(np.abs(one - eight).max(-1))[0].tolist()
    print(f"{matmul}: positions whose logits differ between the two step shapes: {rows}")
    assert rows == []


# One proposal a step: three rows verifying fill 3 to 6 tokens, the (4, 4) and (8, 8) buckets
# (k = 4 spread 3 to 15 tokens over five); a verification step still has another shape
# than plain decoding's 3-row (4, 4) step, and the 1- vs 8-token step shapes are
# test_a_tokens_logits_do_not_depend_on_the_step_shape's.
SPEC = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "cost_model": False}


@pytest.mark.slow
def test_speculation_on_int8_activations_returns_plain_decodings_tokens(int8_llm):
    # Three short repetitive prompts (n-gram drafts to propose), prefilled in one step of the
    # 32-token bucket and decoded three rows at a time: the plain engine runs only the two
    # buckets test_int8_engine_runs_the_interleaved_int8_kernel compiled, the speculating one
    # (32, 4), (4, 4), (8, 8) and, as rows finish apart, (2, 2) and (1, 1) (with k = 4 it ran
    # eight); 16 tokens hold accepted and rejected drafts (asserted below).
    prompts = ["one two three four one two three four one two",
               "apple, banana, cherry, apple, banana,",
               "x = 1\nx = 1\nx"]
    params = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0),
              SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7)]
    plain = int8_llm
    spec = LLM(**BUILTIN_ENGINE, cpu_matmul="native-int8", speculative_config=SPEC)
    assert plain.llm_engine.core.runner.cfg.kernels.int8_activations
    assert spec.llm_engine.core.runner.cfg.kernels.int8_activations
    for p in params:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, p, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, p, use_tqdm=False)]
        assert got == want, p
    stats = spec.llm_engine.core.scheduler.spec_stats
    print(f"speculation on int8 activations: tokens equal to plain decoding's; {stats.num_accepted_tokens} of "
          f"{stats.num_draft_tokens} proposed tokens accepted in {stats.num_drafts} verifications")
    print(f"buckets compiled: plain {sorted(plain.llm_engine.core.runner.compiler.steps)}, "
          f"speculating {sorted(spec.llm_engine.core.runner.compiler.steps)}")
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens   # it speculated, and was corrected

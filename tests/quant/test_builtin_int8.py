"""The built-in model on the default CPU path of a CPU with AVX-512 VNNI: its Q4_1 and Q8_0
blocks, in groups of 16 interleaved rows, meet activations rounded to int8 per 32 values
(``cpu/quant_dot.cc``'s ``jaxllm_dot16_*``), which is llama.cpp's arithmetic
(``vec_dot_q4_1_q8_1``) and vLLM's GGUF kernels' (``ggml_mul_mat_vec_a8``).

The kernel is exact against an emulation of that arithmetic (tests/kernels/test_cpu_quant_dot.py);
what the rounding does to the model is measured here against the float32 engines: a rounded
activation moves by up to 1/254 of its block's largest value, and SmolLM2's activations have
large outliers, so across 30 layers the logits move by a few units (measured: 3.5 of logits
up to 31 on random token ids, where the distributions are flat) and greedy decoding parts
from the float engines after some tokens (measured 3-30 of 32, as llama.cpp parts from them:
docs/BENCHMARKS.md).  ``--cpu-matmul native`` keeps float32 activations.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.cpu import native
from jaxllm.quant import PackedWeight

from conftest import BUILTIN_ENGINE
from tiny_models import paged_logits

pytestmark = pytest.mark.skipif(not native.quant_dot_vnni(),
                                reason="the CPU lacks AVX512F/BW/VNNI: the default keeps float32 activations here")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "List three uses of copper:",
    "In 1969, the first humans",
]


@pytest.mark.slow
def test_default_engine_runs_the_interleaved_int8_kernel(builtin_llm):
    llm = LLM(**BUILTIN_ENGINE)   # --cpu-matmul auto
    runner = llm.llm_engine.core.runner
    assert runner.cfg.kernels.int8_activations
    packed = [w for w in jax.tree.leaves(runner.params, is_leaf=lambda w: isinstance(w, PackedWeight))
              if isinstance(w, PackedWeight)]
    # every matrix, the tied Q8_0 embedding (the LM head, gathered by rows too) included
    assert {(w.type_name, w.interleaved) for w in packed} == {("Q4_1", 16), ("Q8_0", 16)}
    assert runner.weight_bytes() < 100 * 2**20     # the file's bytes: interleaving adds none
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text, out.outputs[0].text

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    ref = builtin_llm.generate(PROMPTS, params, use_tqdm=False)   # float32 activations
    agree = []
    for prompt, g, r in zip(PROMPTS, got, ref):
        gt, rt = g.outputs[0].token_ids, r.outputs[0].token_ids
        n = next((i for i, (a, b) in enumerate(zip(gt, rt)) if a != b), len(rt))
        agree.append(n)
        if n < len(rt):
            top2 = sorted((lp.logprob for lp in r.outputs[0].logprobs[n].values()), reverse=True)[:2]
            print(f"{prompt!r}: int8 parts from float32 at token {n} of 32, float32's top-2 margin "
                  f"{top2[0] - top2[1]:.3f}")
    print(f"int8 vs float32 activations, tokens equal before the first difference: {agree}")
    # The rounding moves logits by a few tenths of a nat at most tokens: the first tokens agree.
    assert min(agree) >= 2 and np.mean(agree) >= 8, agree


@pytest.mark.slow
def test_int8_logits_error_against_the_dequantized_model():
    from jaxllm.models.loader import load_model
    ids = [1] + list(range(300, 340))
    got = paged_logits(load_model(None), ids, scan_layers=False, split=24, matmul="native-int8")
    ref = paged_logits(load_model(None, dequantize=True), ids, scan_layers=False, split=24)
    err = np.abs(got - ref).max()
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    print(f"built-in model, int8 activations vs dequantized float32: max |logit error| {err:.2f} "
          f"(logits up to {np.abs(ref).max():.1f}), argmax equal at {agree:.0%} of {len(ids)} positions")
    assert err < 0.2 * np.abs(ref).max()
    assert agree > 0.5

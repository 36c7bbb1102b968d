"""The built-in model served as shipped: its Q4_1 and Q8_0 blocks kept packed (the
default), against the same file dequantized to float32 (``dequantize=True``, the engine that
equals transformers: tests/models/test_smollm2.py).

The two compute the same function up to the order of float32 sums (the native kernel
scales a 32-weight block's partial sum once instead of each product), so greedy decoding
may part only where the two best tokens are within that rounding of each other.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.host_dispatch import measure
from jaxllm import SamplingParams
from jaxllm.quant import PackedWeight

from support.builtin_prompts import PROMPTS
from support.tiny_models import paged_logits

NEAR_TIE = 0.05   # nats between the reference's top two tokens where a divergence is allowed


@pytest.mark.slow
def test_packed_greedy_equals_dequantized(builtin_llm, builtin_llm_dequantized):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    runner = builtin_llm.llm_engine.core.runner
    assert isinstance(runner.params["embed"], PackedWeight) and runner.params["embed"].type_name == "Q8_0"
    assert runner.weight_bytes() < 100 * 2**20     # the file's 98 MB, not 538 MB of float32
    got = builtin_llm.generate(PROMPTS, params, use_tqdm=False)
    ref = builtin_llm_dequantized.generate(PROMPTS, params, use_tqdm=False)
    equal = 0
    for prompt, g, r in zip(PROMPTS, got, ref):
        gt, rt = g.outputs[0].token_ids, r.outputs[0].token_ids
        n = next((i for i, (a, b) in enumerate(zip(gt, rt)) if a != b), len(rt))
        if n == len(rt):
            equal += 1
            continue
        top2 = sorted((lp.logprob for lp in r.outputs[0].logprobs[n].values()), reverse=True)[:2]
        margin = top2[0] - top2[1]
        print(f"{prompt!r}: parts at token {n} of {len(rt)}, reference top-2 margin {margin:.4f}")
        assert margin < NEAR_TIE, (prompt, n, margin)
    print(f"packed vs dequantized: {equal} of {len(PROMPTS)} continuations of 32 tokens identical")
    assert equal >= len(PROMPTS) - 1


@pytest.mark.slow
def test_packed_logits_error():
    """The packed model's logits (native kernels) against the dequantized model's (XLA
    float32 matmul) on one prompt: the float32 summation-order error, reported."""
    from jaxllm.models.loader import load_model
    ids = [1] + list(range(300, 340))
    packed = paged_logits(load_model(None), ids, scan_layers=False, split=24, matmul="native")
    ref = paged_logits(load_model(None, dequantize=True), ids, scan_layers=False, split=24)
    err = np.abs(packed - ref).max()
    print(f"built-in model, packed vs dequantized: max |logit error| {err:.2e} over {packed.size} logits "
          f"(logits up to {np.abs(ref).max():.1f})")
    assert err < 1e-3 * np.abs(ref).max()
    assert (packed.argmax(-1) == ref.argmax(-1)).mean() > 0.95


def test_packed_steps_are_called_on_flat_arrays(builtin_llm):
    """The packed weights' pytree has None fields (no sharding of their own): each program
    still takes the flat call (runner/flat_call.py), and its tokens are the compiled call's."""
    measure(builtin_llm, rounds=1, tokens=4, prompt="The capital of France is")   # raises if the arms differ
    compiler = builtin_llm.llm_engine.core.runner.compiler
    assert compiler.steps and all(p.fast for p in [*compiler.steps.values(), *compiler.samplers.values()])

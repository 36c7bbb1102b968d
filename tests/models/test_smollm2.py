"""The built-in model: greedy continuations equal transformers' ``generate`` on the same GGUF weights.

transformers reads the GGUF itself (dequantizing it and undoing llama.cpp's Q/K
permutation on its own), so this checks our GGUF loader as well as the forward.
"""

from __future__ import annotations

import os

import pytest
import torch

from jaxllm import SamplingParams
from jaxllm.models.builtin import builtin_gguf_path

# 35 tokens in all: prefilled in one step of the (64, 4) bucket, the one the chat test's 37-token
# prompt needs too, and decoded in (4, 4): the file's one engine compiles two 30-layer programs.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def hf_smollm2():
    from transformers import AutoModelForCausalLM
    path = builtin_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.slow
def test_greedy_continuations_match_transformers(builtin_llm_dequantized, hf_smollm2):
    """Dequantized (``--dequantize``), the engine computes transformers' function exactly."""
    builtin_llm = builtin_llm_dequantized
    tok = builtin_llm.get_tokenizer()
    outs = builtin_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):]
        assert out.outputs[0].token_ids == ref.tolist(), prompt
        assert out.outputs[0].text == tok.decode(ref.tolist(), skip_special_tokens=True)


@pytest.mark.slow
def test_chat_template_is_applied(builtin_llm_dequantized):
    """On the file's one engine (the dequantized one: each program of 30 layers is seconds to
    compile); the chat template is the tokenizer's, whatever the weights' format, and the packed
    engine's continuations equal this one's (tests/quant/test_builtin_packed.py)."""
    builtin_llm = builtin_llm_dequantized
    out = builtin_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    tok = builtin_llm.get_tokenizer()
    text = tok.decode(out.prompt_token_ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert "Paris" in out.outputs[0].text

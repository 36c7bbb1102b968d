"""Every registered architecture against transformers on CPU, in float32.

For a tiny random-weight checkpoint of each variant: the logits of a prompt (computed
through the paged cache, in two prefill chunks, over a permuted block table) match
transformers within 1e-4 relative, and (one engine per family, GREEDY_VARIANTS) 32 greedy
tokens from the engine are identical to ``generate``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support.engines import ONE_SHOT_ENGINE
from support.tiny_models import VARIANTS, load_hf, paged_logits

from jaxllm import LLM, SamplingParams


def prompt_ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 5000, size=n).tolist()


@pytest.fixture(scope="module")
def hf_models(tiny_checkpoints):
    return {name: load_hf(path) for name, path in tiny_checkpoints.items()}


def matmul_backends():
    from jaxllm.cpu import native
    return ["xla", "native"] if native.available() else ["xla"]


def logit_cells():
    """(variant, scan_layers, matmul) cells: each variant runs both layer layouts and both
    matmuls, in two cells instead of their four-cell product, the pairing alternating across
    variants so every (layout, matmul) pair still runs on half of them (the layout and the
    matmul are independent code paths: the product adds no kernel the parts do not run)."""
    mm = matmul_backends()
    cells = []
    for i, v in enumerate(sorted(VARIANTS)):
        first, second = (mm[0], mm[-1]) if i % 2 == 0 else (mm[-1], mm[0])
        cells += [(v, False, first), (v, True, second)]
    return cells


@pytest.mark.parametrize("variant,scan_layers,matmul", logit_cells(),
                         ids=[f"{v}-{'scan' if s else 'unrolled'}-{m}" for v, s, m in logit_cells()])
def test_prompt_logits_match_transformers(variant, scan_layers, matmul, tiny_checkpoints, hf_models):
    ids = prompt_ids(40, seed=1)
    ours = paged_logits(tiny_checkpoints[variant], ids, scan_layers, split=23, matmul=matmul)
    with torch.no_grad():
        ref = hf_models[variant](torch.tensor([ids])).logits[0].numpy()
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"{variant}: max relative logit error {rel:.2e}"


def bf16_cells():
    """(scan_layers, matmul): both layouts and both matmuls in two cells, paired as
    logit_cells pairs them (the layout and the bf16 matmul are independent code paths)."""
    mm = matmul_backends()
    return [(False, mm[-1]), (True, mm[0])]


@pytest.mark.parametrize("scan_layers,matmul", bf16_cells(),
                         ids=[f"{'scan' if s else 'unrolled'}-{m}" for s, m in bf16_cells()])
def test_bf16_weights_and_cache_stay_close(scan_layers, matmul, tiny_checkpoints, hf_models):
    # bf16 on CPU is stored as uint16 bit patterns (formats/storage.py); the result must still
    # be the model's function, to bf16 precision.
    variant = "qwen3_qk_norm"
    ids = prompt_ids(40, seed=2)
    ours = paged_logits(tiny_checkpoints[variant], ids, scan_layers, split=17, matmul=matmul, bf16=True)
    with torch.no_grad():
        ref = hf_models[variant](torch.tensor([ids])).logits[0].numpy()
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 3e-2, f"bf16 max relative logit error {rel:.2e}"


# One engine per family (an engine per variant cost this file half its time in compiles): the
# Llama family end to end as the tiny Llama (llama_gqa_untied).  llama3_rope_tied and
# llama_linear_rope_mha differ from it only in the rope scaling (llama3, linear), the tied head
# and the KV head count (one; MHA): test_prompt_logits_match_transformers checks both against
# transformers in both layer layouts and both matmuls, through the paged cache in two chunks;
# their attention shapes run the native kernel in
# tests/kernels/test_cpu_attention.py::test_every_architecture_equals_the_xla_path, and
# llama3_rope_tied's engine decodes greedily in tests/parallel/test_tensor_parallel.py (tp=2
# equal to one device).
GREEDY_VARIANTS = [v for v in sorted(VARIANTS) if v not in ("llama3_rope_tied", "llama_linear_rope_mha")]


@pytest.mark.parametrize("variant", GREEDY_VARIANTS)
def test_greedy_tokens_match_transformers(variant, tiny_checkpoints, hf_models):
    # Alternate the two layer layouts across variants so both run end to end (scanned: Mixtral
    # and Qwen3-MoE); the tiny Llama (llama_gqa_untied) unrolled, as the session's tiny_llm
    # engine, so that with the shared ONE_SHOT_ENGINE configuration (only the buckets these
    # steps run) its programs are the ones tiny_llm already compiled.
    scan = sorted(VARIANTS).index(variant) % 2 == 0
    llm = LLM(tiny_checkpoints[variant], scan_layers=scan, **ONE_SHOT_ENGINE)
    # Two prompts in one prefill step (26 tokens: the 32-token bucket), then two rows decoding:
    # two programs per engine.  Mistral's window of 16 is crossed by the prompt of 21; prefill
    # in chunks is test_prompt_logits_match_transformers' (two chunks through the paged cache).
    prompts = [prompt_ids(n, seed=10 + n) for n in (5, 21)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    hf = hf_models[variant]
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == ref, f"{variant}, prompt of {len(p)} tokens"
        assert out.prompt_token_ids == p

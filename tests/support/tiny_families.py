"""Tiny random-weight checkpoints of Gemma 2, Gemma 3 (text) and GPT-OSS, every option that
sets each apart switched on, built with transformers (``tiny_models.build_tiny``).

Windows of 8 positions, so that the test prompts (40 tokens, 32 more generated) cross them;
soft caps low enough to bend the random model's scores; a ``query_pre_attn_scalar`` that is
not the head dim; Gemma 3's two RoPE bases with linear scaling on the global layers.
"""

from __future__ import annotations

import weakref

from support.tiny_models import BASE

FAMILY_VARIANTS = {
    # Alternating sliding/full layers (transformers' default pattern for 3 layers).
    "gemma2": ("Gemma2Config", dict(
        head_dim=16, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=10.0, tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh")),
    # Gemma3TextConfig: q/k norm, layer_types, local base and scaled global rope.
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=32, num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
        final_logit_softcapping=15.0, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh")),
    # Alternating sliding/full layers, sinks, q/k/v/o biases, 4 experts top-2 with biases and a
    # SwiGLU limit the random activations reach, YaRN over a short original context.
    "gpt_oss": ("GptOssConfig", dict(
        head_dim=16, num_hidden_layers=3, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=32, swiglu_limit=1.5, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 150000.0})),
}

def build_family(variant: str, out_dir: str, tokenizer_dir: str | None = None, seed: int = 0) -> str:
    from support.tiny_models import build_tiny
    return build_tiny(variant, out_dir, tokenizer_dir, seed, variants=FAMILY_VARIANTS)


__all__ = ["BASE", "FAMILY_VARIANTS", "build_family"]


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory, smollm_tokenizer_dir):
    """name -> path of an HF folder, for every variant in :data:`FAMILY_VARIANTS` (import this
    fixture into a test module to use it)."""
    root = tmp_path_factory.mktemp("tiny_families")
    return {name: build_family(name, str(root / name), smollm_tokenizer_dir) for name in FAMILY_VARIANTS}


# ----------------------------------------------------------------------------- shared test helpers

# (matmul, attention) pairs: the XLA path, the native CPU kernels, the Pallas kernel (interpret).
BACKENDS = [("xla", "xla"), ("native", "native"), ("xla", "pallas")]


def backends() -> list[tuple[str, str]]:
    """:data:`BACKENDS` that run here (the native kernels need AVX2/FMA and a compiler)."""
    from jaxllm.cpu import native
    return [b for b in BACKENDS if "native" not in b or native.available()]


def backend_ids() -> list[str]:
    return [f"{m}-{a}" for m, a in backends()]


def prompt_ids(n: int, seed: int) -> list[int]:
    import numpy as np
    return np.random.default_rng(seed).integers(3, 5000, size=n).tolist()


_GREEDY_REFS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> {(prompt, n): tokens}: each backend's test compares with the same reference, so
transformers generates it once (the entries go with the model)."""


def hf_greedy(hf, prompt: list[int], n: int = 32) -> list[int]:
    """transformers' greedy ``generate`` of ``n`` tokens, never stopping early (computed once
    per model, prompt and ``n``)."""
    import torch
    refs = _GREEDY_REFS.setdefault(hf, {})
    key = (tuple(prompt), n)
    if key not in refs:
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        with torch.no_grad():
            refs[key] = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
    return list(refs[key])


def copy_checkpoint(src: str, dst: str, edit=None, drop: str | None = None) -> str:
    """A copy of the HF folder ``src`` with ``edit(config dict)`` applied and tensor ``drop`` removed."""
    import json
    import os
    import shutil
    shutil.copytree(src, dst)
    if edit is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        edit(cfg)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    if drop is not None:
        from safetensors.numpy import load_file, save_file
        path = os.path.join(dst, "model.safetensors")
        tensors = load_file(path)
        del tensors[drop]
        save_file(tensors, path)
    return dst


def hf_bf16_error(path: str, ids: list[int], ref) -> float:
    """transformers' own bf16 logits' max error relative to its float32 ``ref``: the precision
    a bf16 run of this random model can be held to."""
    import numpy as np
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits[0].float().numpy()
    return float(np.abs(got - ref).max() / np.abs(ref).max())

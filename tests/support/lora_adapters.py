"""PEFT adapters for the LoRA tests: saved by ``peft`` itself, with random non-zero ``B``
(peft initialises B to zero, which would make every adapter the base model), and the
transformers + peft greedy reference."""

from __future__ import annotations

import json
import os

import numpy as np

# name -> LoraConfig keywords; different ranks, target forms and scalings.
ADAPTERS = {
    "a4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    "b8": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True),
    "c8": dict(r=8, lora_alpha=4, target_modules=["k_proj", "gate_proj", "up_proj"]),
}


# Attention-only adapters, for an MoE base (its experts are no LoRA target here).
ATTENTION_ADAPTERS = {
    "a4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]),
    "b8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], use_rslora=True),
}


def build_set(root: str, tokenizer_dir: str | None = None, build=None, adapters: dict | None = None) -> dict[str, str]:
    """A tiny base (``base``; ``build(out_dir)``, default the tiny Llama) and every adapter of
    ``adapters`` (default :data:`ADAPTERS`) under ``root``: name -> path."""
    import torch
    import transformers

    from support.tiny_models import build_tiny
    base_dir = os.path.join(root, "base")
    paths = {"base": build(base_dir) if build else build_tiny("llama_gqa_untied", base_dir, tokenizer_dir)}
    model = transformers.AutoModelForCausalLM.from_pretrained(paths["base"], dtype=torch.float32)
    for i, (name, kw) in enumerate((adapters or ADAPTERS).items()):
        paths[name] = save_adapter(model, os.path.join(root, name), seed=i + 1, **kw)
    return paths


def save_adapter(model, out_dir: str, seed: int, **lora_kwargs) -> str:
    """A LoRA of the transformers ``model`` with every A and B random, saved by peft (the
    model is left as it was)."""
    import peft
    import torch

    pm = peft.get_peft_model(model, peft.LoraConfig(**lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.6 / np.sqrt(p.shape[-1])))
    pm.save_pretrained(out_dir)
    pm.unload()
    return out_dir


def edit_config(src: str, dst: str, **changes) -> str:
    """A copy of adapter ``src`` with ``adapter_config.json`` fields changed (None deletes)."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
            b.write(a.read())
    path = os.path.join(dst, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(path, "w") as f:
        json.dump(cfg, f)
    return dst


def bf16_rounded(src: str, dst: str) -> str:
    """A copy of adapter ``src`` whose ``lora_A``/``lora_B`` are rounded to bfloat16 (stored
    float32 again): what ``--lora-dtype bfloat16`` holds in its slots, for peft to run in
    float32.  (The engine rounds ``B`` with the scale folded in: the same numbers when the scale
    is a power of two.)"""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    edit_config(src, dst)
    path = os.path.join(dst, "adapter_model.safetensors")
    tensors = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def hf_greedy(base_path: str, adapters: dict, prompts: list[list[int]], n: int) -> dict:
    """transformers (+ peft for each adapter path; None: the base) greedy continuations,
    float32: {name: path or None} -> {(name, prompt index): tokens}."""
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    out = {}
    with torch.no_grad():
        for name, path in adapters.items():
            model = base if path is None else peft.PeftModel.from_pretrained(base, path)
            model.eval()
            model.generation_config.eos_token_id = None
            model.generation_config.pad_token_id = 0
            for i, p in enumerate(prompts):
                out[(name, i)] = model.generate(torch.tensor([p]), max_new_tokens=n,
                                                do_sample=False)[0, len(p):].tolist()
            if path is not None:
                base = model.unload()
    return out

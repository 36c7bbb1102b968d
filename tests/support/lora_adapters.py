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


def save_adapter(base_path: str, out_dir: str, seed: int, **lora_kwargs) -> str:
    """A LoRA of the HF model at ``base_path`` with every A and B random, saved by peft."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    pm = peft.get_peft_model(model, peft.LoraConfig(**lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.6 / np.sqrt(p.shape[-1])))
    pm.save_pretrained(out_dir)
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


def hf_greedy(base_path: str, adapter: str | None, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers (+ peft when ``adapter``) greedy continuations, float32."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.no_grad():
        for p in prompts:
            outs.append(model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist())
    return outs

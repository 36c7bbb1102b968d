"""A tiny random ``Gemma3ForConditionalGeneration`` (float32) built with transformers: SigLIP
vision hidden 32, 2 layers, 56 px images in 14 px patches (4x4) pooled 2x2 to 4 tokens per
image; a 2-layer Gemma 3 text model with a sliding window."""

from __future__ import annotations

import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

IMAGE_TOKEN, BOI, EOI = 250, 251, 252


def tiny_config(image_size: int = 56, tokens_per_image: int = 4) -> Gemma3Config:
    """A tiny config: 56 px images -> 4x4 patches of 14 px, pooled 2x2 -> 4 tokens per image."""
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                sliding_window=8, layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-6,
                query_pre_attn_scalar=16, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=image_size, patch_size=14, layer_norm_eps=1e-6, vision_use_head=False)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=tokens_per_image,
                       image_token_index=IMAGE_TOKEN, boi_token_index=BOI, eoi_token_index=EOI)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    return cfg


def tiny_model(seed: int = 0, **kw) -> Gemma3ForConditionalGeneration:
    """Random weights (norm weights and the projector included, which transformers inits to zeros)."""
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(tiny_config(**kw)).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "mm_input_projection" in name or "embedding" in name:
                p.normal_(0.0, 0.3 if "norm" in name else 0.2)
    return model

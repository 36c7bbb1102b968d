"""A tiny random ``Qwen3_5ForConditionalGeneration`` (float32) built with transformers: a vision
tower of hidden 32, 2 blocks, 2 heads (head dim 16), 4 px patches, 2x2 patch merger into the
text hidden 64, a 4x4 learned position grid (interpolated to each image's grid); the text side is
tests/support/tiny_hybrid.py's hybrid Qwen3.5 with M-RoPE sections."""

from __future__ import annotations

import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from support.tiny_hybrid import COMMON

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 250, 251, 252, 253

VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
              hidden_act="gelu_pytorch_tanh")


def tiny_config() -> Qwen3_5Config:
    # head_dim 16, partial rotary 0.5 -> 8 rotary dims = 4 frequencies, split t/h/w as 2/1/1
    text = dict(COMMON, intermediate_size=48, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(VISION), image_token_id=IMAGE_TOKEN,
                        video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                        vision_end_token_id=VISION_END)
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    return cfg


def tiny_model(seed: int = 0) -> Qwen3_5ForConditionalGeneration:
    """Random weights, the norms and the learned position grid included (transformers inits norms to 1)."""
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(tiny_config()).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name and ("norm" in name or "pos_embed" in name or name.endswith("bias")):
                p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.2)
    return model

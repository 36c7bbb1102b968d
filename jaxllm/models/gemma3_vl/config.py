"""Gemma 3's vision side, read off a ``Gemma3ForConditionalGeneration`` config: the SigLIP
tower's shape, the projector's pooling (``mm_tokens_per_image``) and the image token ids."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class VisionConfig:
    """The SigLIP vision tower and the multimodal projector of a Gemma 3 checkpoint."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    text_hidden_size: int
    mm_tokens_per_image: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @property
    def pool(self) -> int:
        """The projector's average-pool kernel (and stride), in patches."""
        return self.patches_per_side // self.tokens_per_side

    @classmethod
    def from_hf(cls, hf) -> VisionConfig:
        """A transformers ``Gemma3Config`` -> its vision config; shapes the projector cannot pool refused."""
        v, t = hf.vision_config, hf.text_config
        act = getattr(v, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_new"):
            raise ValueError(f"Gemma3ForConditionalGeneration: vision hidden_act {act!r} is not supported")
        if getattr(v, "vision_use_head", False):
            raise ValueError("Gemma3ForConditionalGeneration: vision_use_head=true is not supported")
        cfg = cls(hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                  num_layers=v.num_hidden_layers, num_heads=v.num_attention_heads, image_size=v.image_size,
                  patch_size=v.patch_size, layer_norm_eps=v.layer_norm_eps, text_hidden_size=t.hidden_size,
                  mm_tokens_per_image=hf.mm_tokens_per_image, image_token_id=hf.image_token_index,
                  boi_token_id=hf.boi_token_index, eoi_token_id=hf.eoi_token_index)
        side = cfg.tokens_per_side
        if side * side != cfg.mm_tokens_per_image or cfg.patches_per_side % side:
            raise ValueError(f"Gemma3ForConditionalGeneration: mm_tokens_per_image={cfg.mm_tokens_per_image} "
                             f"does not pool {cfg.patches_per_side}x{cfg.patches_per_side} patches evenly")
        return cfg

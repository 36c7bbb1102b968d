"""The Qwen3.5 vision tower's shape, read off a ``Qwen3_5ForConditionalGeneration`` config
(its ``vision_config`` and the image token ids).  Qwen3-VL's tower has the same fields (it adds
DeepStack mergers, which this family does not read)."""

from __future__ import annotations

from dataclasses import dataclass

# the MLP activations transformers' ACT2FN names -> whether jax.nn.gelu's tanh form is meant
_GELU = {"gelu_pytorch_tanh": True, "gelu_new": True, "gelu": False}


@dataclass(frozen=True)
class VisionConfig:
    """The ViT (2D rotary, learned position grid) and the 2x2 patch merger of a Qwen3.5 checkpoint."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int                # the text model's hidden size (the merger's output)
    num_position_embeddings: int        # a side x side learned grid, resampled to each image's grid
    rope_theta: float
    gelu_tanh: bool                     # the blocks' MLP activation (the merger's GELU is always exact)
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    layer_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        """The learned position grid's side (``num_position_embeddings`` is its square)."""
        return int(self.num_position_embeddings ** 0.5)

    @property
    def patch_dim(self) -> int:
        """One patch row of ``pixel_values``: C * temporal_patch_size * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches folded into one text token by the merger."""
        return self.spatial_merge_size ** 2

    @classmethod
    def from_hf(cls, hf) -> VisionConfig:
        """A transformers ``Qwen3_5Config`` (or its dict) -> the vision config; what the tower
        cannot run is refused by name."""
        get = (lambda o, k, d=None: o.get(k, d)) if isinstance(hf, dict) else (lambda o, k, d=None: getattr(o, k, d))
        v = get(hf, "vision_config")
        if v is None:
            raise ValueError("Qwen3_5ForConditionalGeneration: config.json has no vision_config")
        act = get(v, "hidden_act", "gelu_pytorch_tanh")
        if act not in _GELU:
            raise ValueError(f"Qwen3_5ForConditionalGeneration: vision hidden_act {act!r} is not supported "
                             f"(one of {sorted(_GELU)})")
        rope = get(v, "rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"Qwen3_5ForConditionalGeneration: vision rope_type {rope.get('rope_type')!r} "
                             "is not supported (axial only)")

        def size(name, default):
            x = get(v, name, default)
            if isinstance(x, (list, tuple)):
                if len(set(x)) != 1:
                    raise ValueError(f"Qwen3_5ForConditionalGeneration: vision {name}={x} (non-square) "
                                     "is not supported")
                x = x[0]
            return int(x)
        cfg = cls(depth=int(get(v, "depth")), hidden_size=int(get(v, "hidden_size")),
                  intermediate_size=int(get(v, "intermediate_size")), num_heads=int(get(v, "num_heads")),
                  in_channels=int(get(v, "in_channels", 3)), patch_size=size("patch_size", 16),
                  temporal_patch_size=size("temporal_patch_size", 2),
                  spatial_merge_size=int(get(v, "spatial_merge_size", 2)),
                  out_hidden_size=int(get(v, "out_hidden_size")),
                  num_position_embeddings=int(get(v, "num_position_embeddings")),
                  rope_theta=float(rope.get("rope_theta", 10000.0)), gelu_tanh=_GELU[act],
                  image_token_id=int(get(hf, "image_token_id")),
                  vision_start_token_id=int(get(hf, "vision_start_token_id")),
                  vision_end_token_id=int(get(hf, "vision_end_token_id")))
        if cfg.grid_side ** 2 != cfg.num_position_embeddings:
            raise ValueError(f"Qwen3_5ForConditionalGeneration: num_position_embeddings="
                             f"{cfg.num_position_embeddings} is not a square grid")
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise ValueError(f"Qwen3_5ForConditionalGeneration: vision head dim {cfg.hidden_size}/{cfg.num_heads} "
                             "must be a multiple of 4 (2D rotary)")
        return cfg

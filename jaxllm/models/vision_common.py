"""What every vision-language family's checkpoint split hands the engine: ``VisionWeights``, the
image encoder's config, host tensors and folder (models/gemma3_vl/, models/qwen3_5_vl/).  The
engine picks the family's preprocessing and encoder by the config's type."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionWeights:
    """The image encoder of a checkpoint: its config (the family's ``VisionConfig``), its host
    tensors (HF names), its folder (where ``preprocessor_config.json`` lives)."""

    cfg: object
    tensors: dict
    path: str

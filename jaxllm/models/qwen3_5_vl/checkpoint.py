"""A ``Qwen3_5ForConditionalGeneration`` checkpoint split in two for the loader: the text
model's tensors under the names ``models/qwen3_next`` reads (``model.language_model.X`` ->
``model.X``; ``lm_head`` and ``mtp.*`` as they are) and the vision tower's (``model.visual.*``),
checked whole against the tower's config (``vision.check_tensors``).

The engine's image path (runner/vision.py, multimodal/prompt_images.py) is Gemma 3's so far:
fixed-size images, no M-RoPE.  Until it learns this family's per-grid encoder and 3D positions,
the split hands the loader no image side (``None``): the checkpoint serves text, and an image
sent to it is refused as to a text-only model.  ``VisionWeights`` is what it will hand over."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from jaxllm.errors import ModelLoadError
from jaxllm.models.qwen3_5_vl.config import VisionConfig
from jaxllm.models.qwen3_5_vl.vision import check_tensors

log = logging.getLogger("jaxllm.models")

_TEXT = "model.language_model."
_VISUAL = "model.visual."


@dataclass(frozen=True)
class VisionWeights:
    """The image encoder of a checkpoint: its config, its host tensors (HF names), its folder
    (where ``preprocessor_config.json`` lives)."""

    cfg: VisionConfig
    tensors: dict
    path: str


def split_text_and_vision(hf, tensors: dict, where: str) -> tuple[dict, VisionWeights]:
    """tensors (name -> (array, file)) -> (the text model's, under models/qwen3_next's names;
    the vision side, checked).  A config or tensor set the tower cannot run is a ModelLoadError
    naming it."""
    try:
        cfg = VisionConfig.from_hf(hf)
    except ValueError as e:
        raise ModelLoadError(f"{where}: {e}") from None
    text, vision = {}, {}
    for name, (arr, fname) in tensors.items():
        if name.startswith(_VISUAL):
            vision[name] = np.asarray(arr)
        else:
            text["model." + name[len(_TEXT):] if name.startswith(_TEXT) else name] = (arr, fname)
    try:
        check_tensors(cfg, vision)
    except ValueError as e:
        raise ModelLoadError(f"{where}: {e}") from None
    return text, VisionWeights(cfg, vision, where)


def split_checkpoint(hf, tensors: dict, where: str) -> tuple[dict, None]:
    """The loader's hook (``Family.vision``): the text model's tensors, the vision tower's
    checked and set aside (see the module docstring: no image side for the engine yet)."""
    text, _ = split_text_and_vision(hf, tensors, where)
    log.info("%s: Qwen3_5ForConditionalGeneration serves text; its images are not wired into the engine yet "
             "(an image part is refused as to a text-only model)", where)
    return text, None

"""A ``Qwen3_5ForConditionalGeneration`` checkpoint split in two for the loader: the text
model's tensors under the names ``models/qwen3_next`` reads (``model.language_model.X`` ->
``model.X``; ``lm_head`` and ``mtp.*`` as they are) and the vision tower's (``model.visual.*``),
checked whole against the tower's config (``vision.check_tensors``), handed to the engine as
``VisionWeights`` (its encoder: runner/vision.py; its prompts: multimodal/qwen_prompt_images.py)."""

from __future__ import annotations

import numpy as np

from jaxllm.errors import ModelLoadError
from jaxllm.models.qwen3_5_vl.config import VisionConfig
from jaxllm.models.qwen3_5_vl.vision import check_tensors
from jaxllm.models.vision_common import VisionWeights

_TEXT = "model.language_model."
_VISUAL = "model.visual."


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


def split_checkpoint(hf, tensors: dict, where: str) -> tuple[dict, VisionWeights]:
    """The loader's hook (``Family.vision``): the text model's tensors and the vision side."""
    return split_text_and_vision(hf, tensors, where)

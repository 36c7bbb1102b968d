"""A ``Gemma3ForConditionalGeneration`` checkpoint split in two: the text model's tensors under
the names ``models/gemma`` reads (``model.language_model.X`` -> ``model.X``), and the vision
tower + projector's tensors, kept on the host for the engine's encoder (``vision.py``).

Both layouts transformers has saved are read: ``model.language_model.* / model.vision_tower.*``
(transformers >= 4.52) and the older ``language_model.model.* / vision_tower.vision_model.*``
(the Hub's google/gemma-3-*-it files; transformers 5 saves ``vision_tower.*``)."""

from __future__ import annotations

import numpy as np

from jaxllm.errors import ModelLoadError
from jaxllm.models.gemma3_vl.config import VisionConfig
from jaxllm.models.vision_common import VisionWeights

# old name prefix -> the name vision.load_params / models/gemma read
_RENAMES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("vision_tower.vision_model.", "model.vision_tower."),
    ("model.vision_tower.vision_model.", "model.vision_tower."),
    ("vision_tower.", "model.vision_tower."),            # what transformers 5 saves
    ("multi_modal_projector.", "model.multi_modal_projector."),
)
_VISION = ("model.vision_tower.", "model.multi_modal_projector.")


def _rename(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def split_checkpoint(hf, tensors: dict, where: str) -> tuple[dict, VisionWeights]:
    """tensors (name -> (array, file)) -> (the text model's, under models/gemma's names; the
    vision side).  A config the encoder cannot run is a ModelLoadError naming it."""
    try:
        cfg = VisionConfig.from_hf(hf)
    except ValueError as e:
        raise ModelLoadError(f"{where}: {e}") from None
    text, vision = {}, {}
    for name, (arr, fname) in tensors.items():
        new = _rename(name)
        if new.startswith(_VISION):
            vision[new] = np.asarray(arr)
        else:
            text[new] = (arr, fname)
    return text, VisionWeights(cfg, vision, where)

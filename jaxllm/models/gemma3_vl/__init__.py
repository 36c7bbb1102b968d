"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): ``config.py`` (the vision side of its
config), ``vision.py`` (SigLIP tower + projector), ``processing.py`` (placeholder expansion and
the image groups of the bidirectional attention), ``checkpoint.py`` (the checkpoint's two halves).  The text side is ``models/gemma/``."""

from jaxllm.models.gemma3_vl.checkpoint import VisionWeights, split_checkpoint
from jaxllm.models.gemma3_vl.config import VisionConfig
from jaxllm.models.gemma3_vl.processing import expand_placeholders, image_groups, visible_upto
from jaxllm.models.gemma3_vl.vision import PARAM_AXES, encode, load_params, split_sizes, tp_layout

__all__ = ["PARAM_AXES", "VisionConfig", "VisionWeights", "encode", "expand_placeholders", "image_groups",
           "load_params", "split_checkpoint", "split_sizes", "tp_layout", "visible_upto"]

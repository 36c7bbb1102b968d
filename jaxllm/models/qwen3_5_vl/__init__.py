"""Qwen3.5 with images (``Qwen3_5ForConditionalGeneration``): ``config.py`` (the vision side of
its config), ``vision.py`` (the 2D-rotary ViT + patch merger), ``positions.py`` (placeholder expansion,
M-RoPE positions), ``checkpoint.py`` (the checkpoint's two halves; the engine serves the text
half so far).  The pixels come from ``jaxllm/multimodal/qwen_image_processor.py``; the text
side is ``models/qwen3_next/`` (``forward``'s ``image_rows`` and ``rope_positions``)."""

from jaxllm.models.qwen3_5_vl.checkpoint import VisionWeights, split_checkpoint, split_text_and_vision
from jaxllm.models.qwen3_5_vl.config import VisionConfig
from jaxllm.models.qwen3_5_vl.positions import expand_placeholders, mrope_axes, mrope_positions
from jaxllm.models.qwen3_5_vl.vision import (PARAM_AXES, check_tensors, encode, grid_inputs, load_params, num_tokens,
                                             split_sizes, tensor_shapes, tp_layout)

__all__ = ["PARAM_AXES", "VisionConfig", "VisionWeights", "check_tensors", "encode", "expand_placeholders",
           "grid_inputs", "load_params", "mrope_axes", "mrope_positions", "num_tokens", "split_checkpoint",
           "split_sizes", "split_text_and_vision", "tensor_shapes", "tp_layout"]

"""Qwen3.5 with images (``Qwen3_5ForConditionalGeneration``): ``config.py`` (the vision side of
its config), ``vision.py`` (the 2D-rotary ViT + patch merger), ``positions.py`` (placeholder expansion, M-RoPE).  The pixels come from
``jaxllm/multimodal/qwen_image_processor.py``; the text side is ``models/qwen3_next/``."""

from jaxllm.models.qwen3_5_vl.config import VisionConfig
from jaxllm.models.qwen3_5_vl.positions import expand_placeholders, mrope_axes, mrope_positions
from jaxllm.models.qwen3_5_vl.vision import encode, grid_inputs, load_params, num_tokens

__all__ = ["VisionConfig", "encode", "expand_placeholders", "grid_inputs", "load_params", "mrope_axes",
           "mrope_positions", "num_tokens"]

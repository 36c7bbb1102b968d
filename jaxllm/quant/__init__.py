"""Weights kept in their GGUF quantized blocks: the packed arrays and the ways to use them.

``gguf_blocks`` splits a GGUF tensor's raw bytes into per-field arrays (``PackedWeight``)
and dequantizes them in jnp; ``matmul`` is the XLA path that dequantizes inside the
jitted function.  Each has a numpy reference beside it.
"""

from jaxllm.quant.gguf_blocks import (BLOCK_SIZE, QK_K, SUPPORTED_TYPES, PackedWeight,
                                      block_size, dequantize, dequantize_reference, pack)
from jaxllm.quant.matmul import matmul, matmul_reference

__all__ = ["BLOCK_SIZE", "QK_K", "SUPPORTED_TYPES", "PackedWeight", "block_size", "pack", "dequantize",
           "dequantize_reference", "matmul", "matmul_reference"]

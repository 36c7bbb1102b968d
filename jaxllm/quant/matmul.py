"""``x @ W^T`` for a weight kept packed in GGUF blocks: the XLA path and its reference.

The XLA path dequantizes inside the jitted function and contracts the last axes of both
operands in float32, the project's ``[out, in]`` convention (``jaxllm/layers/linear.py``).
XLA may fuse the dequantization into the dot's operand; where it does not, the float32
weight is a temporary of the step, never a resident copy.  Kernels that read the blocks
directly belong beside this path and are tested against ``matmul_reference``.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.quant.gguf_blocks import PackedWeight, dequantize, dequantize_reference


def matmul(x: jax.Array, pw: PackedWeight) -> jax.Array:
    """x [T, in] @ W[out, in]^T -> float32 [T, out], W dequantized from ``pw`` in the step."""
    if x.shape[-1] != pw.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the {pw.type_name} weight of shape "
                         f"{pw.shape} takes {pw.shape[1]}")
    w = dequantize(pw)  # [out, in] f32
    # HIGHEST: a true float32 dot on every target (a GPU's default may round inputs to TF32)
    return jax.lax.dot_general(x.astype(jnp.float32), w, (((x.ndim - 1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


def matmul_reference(x: np.ndarray, raw: np.ndarray, ggml_type, shape) -> np.ndarray:
    """The oracle: float64 ``x @ W^T`` with W from ``gguf.quants.dequantize``; [T, out] f64."""
    w = dequantize_reference(raw, ggml_type, shape).astype(np.float64)  # [out, in]
    return np.asarray(x, dtype=np.float64) @ w.T

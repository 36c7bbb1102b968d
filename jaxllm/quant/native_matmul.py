"""``x @ W^T`` on CPU with a native kernel that reads the GGUF blocks directly.

``linear_packed`` calls the XLA FFI targets of ``jaxllm/cpu/quant_linear.cc`` (built and
registered by ``jaxllm.cpu.native.quant_available``): each block is widened and scaled in
registers, so no float32 copy of the weight exists even for one step.  It is jittable and
composes with other ops like any XLA custom call; ``matmul.matmul`` is the portable path and
``matmul.matmul_reference`` the oracle for both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.cpu import native
from jaxllm.quant.gguf_blocks import PackedWeight

NATIVE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")
INT8_ACTIVATION_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")   # quant_dot.cc


def linear_packed(x: jax.Array, pw: PackedWeight, int8_activations: bool = False) -> jax.Array:
    """x [M, K] (any float dtype) @ W[N, K]^T -> float32 [M, N], W read from ``pw``'s blocks;
    ``int8_activations``: x's 32-value blocks quantized to int8 in the call and multiplied in
    integer arithmetic (``quant_dot.cc``, as llama.cpp computes), else float32 FMAs
    (``quant_linear.cc``)."""
    if pw.type_name not in NATIVE_TYPES:
        raise ValueError(f"no native CPU kernel for {pw.type_name or 'untyped'} weights "
                         f"(native: {', '.join(NATIVE_TYPES)}); use jaxllm.quant.matmul")
    if int8_activations and pw.type_name not in INT8_ACTIVATION_TYPES:
        raise ValueError(f"no 8-bit-activation kernel for {pw.type_name} weights "
                         f"(those: {', '.join(INT8_ACTIVATION_TYPES)})")
    if x.ndim != 2 or x.shape[-1] != pw.shape[1]:
        raise ValueError(f"x of shape {tuple(x.shape)} is not [M, {pw.shape[1]}] for the "
                         f"{pw.type_name} weight of shape {pw.shape}")
    if not native.quant_available():
        raise RuntimeError("the native packed-block matmul is unavailable here (see the "
                           "jaxllm.cpu log); use jaxllm.quant.matmul")
    out = jax.ShapeDtypeStruct((x.shape[0], pw.shape[0]), jnp.float32)
    x = x.astype(jnp.float32)
    # the target's operands, in its handler's order (quant_linear.cc)
    fields = {"Q8_0": (pw.d, pw.qs), "Q4_0": (pw.d, pw.qs), "Q4_1": (pw.d, pw.m, pw.qs),
              "Q5_0": (pw.d, pw.qh, pw.qs), "Q5_1": (pw.d, pw.m, pw.qh, pw.qs),
              "Q4_K": (pw.d, pw.dmin, pw.scales, pw.qs), "Q5_K": (pw.d, pw.dmin, pw.scales, pw.qh, pw.qs),
              "Q6_K": (pw.ql, pw.qh, pw.scales, pw.d), "F16": (pw.bits,), "BF16": (pw.bits,)}[pw.type_name]
    # (jaxllm_linear_bf16 is the dense panel-layout kernel of linear.cc: these are row-major bits)
    name = f"gguf_{pw.type_name.lower()}" if pw.type_name in ("F16", "BF16") else pw.type_name.lower()
    target = f"jaxllm_{'dot' if int8_activations else 'linear'}_{name}"
    return jax.ffi.ffi_call(target, out)(x, *fields)                               # [M, N]

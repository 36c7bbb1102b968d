"""``x @ W^T`` on CPU with a native kernel that reads the GGUF blocks directly.

``linear_packed`` calls the XLA FFI targets of ``jaxllm/cpu/quant_linear.cc`` (built and
registered by ``jaxllm.cpu.native.quant_available``): each block is widened and scaled in
registers, so no float32 copy of the weight exists even for one step.  It is jittable and
composes with other ops like any XLA custom call; ``matmul.matmul`` is the portable path and
``matmul.matmul_reference`` the oracle for both.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.cpu import native
from jaxllm.quant.gguf_blocks import PackedWeight

NATIVE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")
INT8_ACTIVATION_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")   # quant_dot.cc
INT16_ACTIVATION_TYPES = ("Q4_1",)   # quant_dot.cc's jaxllm_dot_i16_* (--cpu-matmul native-int16)
INT16_INTERLEAVED_TYPES = ("Q4_1", "Q8_0")   # its jaxllm_dot16_i16_*: in interleaved rows only (AVX-512 VNNI)
INTERLEAVED_TYPES = ("Q8_0", "Q4_0", "Q4_1")   # quant_dot.cc's jaxllm_dot16_* (AVX-512 VNNI)
GROUP = 16   # rows per interleaved group: one int32 lane each in a 512-bit register


def can_interleave(w) -> bool:
    """Whether ``w`` (one unstacked weight) can take the interleaved layout: a type the VNNI
    kernel has, rows a multiple of 16."""
    return (isinstance(w, PackedWeight) and not w.interleaved and w.type_name in INTERLEAVED_TYPES
            and w.shape[0] % GROUP == 0 and np.ndim(w.d) == 2)


def _int16_types(w: PackedWeight) -> tuple[str, ...]:
    """The types with an int16-activation kernel in ``w``'s layout."""
    return INT16_INTERLEAVED_TYPES if w.interleaved else INT16_ACTIVATION_TYPES


def has_int16_kernel(w: PackedWeight) -> bool:
    """Whether ``w``, as laid out, has an int16-activation kernel: Q4_1 row-major or
    interleaved, Q8_0 interleaved only."""
    return w.type_name in _int16_types(w)


def interleave_rows(w: PackedWeight) -> PackedWeight:
    """``w`` (host arrays) with each group of 16 rows interleaved for ``jaxllm_dot16_*``:
    the fields keep their shapes, but within a group's rows, qs [16, nb, S] is stored as
    [nb, S / 4, 16, 4] (4 bytes of every row in turn) and d, m [16, nb] as [nb, 16]."""
    if not can_interleave(w):
        raise ValueError(f"a {w.type_name} weight of shape {w.shape} cannot be interleaved "
                         f"(types {', '.join(INTERLEAVED_TYPES)}, rows a multiple of {GROUP})")
    n, nb = np.shape(w.d)
    g = n // GROUP

    def scales(a):   # [N, nb] -> per group [nb, 16]
        return None if a is None else np.asarray(a).reshape(g, GROUP, nb).transpose(0, 2, 1).reshape(n, nb)
    qs = np.asarray(w.qs)
    size = qs.shape[-1]
    qs = qs.reshape(g, GROUP, nb, size // 4, 4).transpose(0, 2, 3, 1, 4).reshape(n, nb, size)
    return dataclasses.replace(w, d=scales(w.d), m=scales(w.m), qs=qs, interleaved=GROUP)


def _group_views(w: PackedWeight):
    """The interleaved fields as [G, nb, 16] (d, m) and [G, nb, S / 4, 16, 4] (qs)."""
    n, nb = w.d.shape
    size = w.qs.shape[-1]
    v = lambda a: None if a is None else a.reshape(n // GROUP, nb, GROUP)  # noqa: E731
    return v(w.d), v(w.m), w.qs.reshape(n // GROUP, nb, size // 4, GROUP, 4)


def take_interleaved_rows(w: PackedWeight, ids: jax.Array) -> PackedWeight:
    """Rows ``ids`` [T] of an interleaved weight as a row-major ``PackedWeight`` [T, in]."""
    d, m, qs = _group_views(w)
    g, lane = ids // GROUP, ids % GROUP
    rows = dict(d=d[g, :, lane], m=None if m is None else m[g, :, lane],
                qs=qs[g, :, :, lane, :].reshape(ids.shape[0], d.shape[1], -1))
    return PackedWeight(**rows, type_name=w.type_name, shape=(ids.shape[0], w.shape[1]))


def deinterleave_rows(w: PackedWeight) -> PackedWeight:
    """The row-major ``PackedWeight`` of an interleaved one (jittable): what every path but
    ``jaxllm_dot16_*`` reads."""
    d, m, qs = _group_views(w)
    n, nb = w.d.shape
    rows = lambda a: None if a is None else jnp.swapaxes(a, 1, 2).reshape(n, nb)  # noqa: E731
    return PackedWeight(d=rows(d), m=rows(m), qs=jnp.transpose(qs, (0, 3, 1, 2, 4)).reshape(w.qs.shape),
                        type_name=w.type_name, shape=w.shape, activations=w.activations)


def linear_packed(x: jax.Array, pw: PackedWeight, int8_activations: bool = False,
                  int16_activations: bool = False) -> jax.Array:
    """x [M, K] (any float dtype) @ W[N, K]^T -> float32 [M, N], W read from ``pw``'s blocks;
    ``int8_activations``: x's 32-value blocks quantized to int8 in the call and multiplied in
    integer arithmetic (``quant_dot.cc``, as llama.cpp computes); ``int16_activations`` (Q4_1):
    the same with x rounded to int16 (``quant_dot.cc``'s ``jaxllm_dot_i16_q4_1``, or
    ``jaxllm_dot16_i16_q4_1`` for interleaved rows: the same integer sums); else float32
    FMAs (``quant_linear.cc``)."""
    if pw.type_name not in NATIVE_TYPES:
        raise ValueError(f"no native CPU kernel for {pw.type_name or 'untyped'} weights "
                         f"(native: {', '.join(NATIVE_TYPES)}); use jaxllm.quant.matmul")
    if int8_activations and pw.type_name not in INT8_ACTIVATION_TYPES:
        raise ValueError(f"no 8-bit-activation kernel for {pw.type_name} weights "
                         f"(those: {', '.join(INT8_ACTIVATION_TYPES)})")
    if int16_activations and (int8_activations or not has_int16_kernel(pw)):
        raise ValueError(f"no 16-bit-activation kernel for {pw.type_name} weights "
                         f"{'in interleaved rows ' if pw.interleaved else ''}(those: {', '.join(_int16_types(pw))})")
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
    target = f"jaxllm_{'dot_i16' if int16_activations else 'dot' if int8_activations else 'linear'}_{name}"
    if pw.interleaved:
        if not (int8_activations or int16_activations):
            raise ValueError("an interleaved weight is read by the 8- and 16-bit-activation kernels only; "
                             "deinterleave_rows it for the float32 one")
        target = f"jaxllm_dot16_{'i16_' if int16_activations else ''}{name}"
    return jax.ffi.ffi_call(target, out)(x, *fields)                               # [M, N]


def int8_split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] float32 -> (x1, r), x = x1 + r: x1 is x rounded as ``quant_dot.cc`` rounds an
    activation block (scale max|x| / 127 per 32 values, round to nearest even), so that x1
    rounds to itself, and r the remainder (at most half a step of x1's grid per value)."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)                                     # [M, nb, 32]
    d = jnp.max(jnp.abs(xb), axis=-1, keepdims=True) / 127.0          # [M, nb, 1]
    inv = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
    x1 = (jnp.round(xb * inv) * d).reshape(m, k)
    return x1, x - x1


def linear_packed_split(x: jax.Array, pw: PackedWeight) -> jax.Array:
    """x [M, K] @ W^T -> float32 [M, N] through the int8-activation kernel on x rounded to int8
    (``int8_split``'s x1, which the kernel rounds to itself) and on the remainder, whose own
    rounding error is at most 1/254 of a remainder that is at most 1/254 of the block's
    largest value: about float32 activations' accuracy.

    Both halves go through one kernel call as 2M rows, so the weights stream from memory once
    (at batch 1 the call is bound by that read, not by the doubled integer work).  The kernels
    compute each row of x alone (the same ops whatever rows share the call), so the sum is the
    same bits as two calls' and a token's logits do not depend on the step's shape."""
    m = x.shape[0]
    x1, r = int8_split(x.astype(jnp.float32))                         # [M, K] each
    y = linear_packed(jnp.concatenate([x1, r]), pw, int8_activations=True)   # [2M, N]
    return y[:m] + y[m:]

"""``x @ W^T`` for a weight-only quantized weight (``formats/int_weights.QuantizedLinear``:
int8, int4 with group scales and zero points, fp8 with per-channel / per-tensor / block
scales) as a Pallas kernel: the weight is read in its stored width and widened tile by tile
in registers, never as a float32 copy.

One program per ``[BM, BN]`` output tile (grid: row blocks of ``x``, blocks of output
features) loops over the input features in steps of ``BK``; each step loads the ``[BN, BK]``
tile of quantized values, subtracts the zero point, takes the float32 product with the
``[BM, BK]`` tile of ``x`` and adds it times the step's scales (``BK`` is the group size for a
grouped weight, so one scale per output feature and step: the scale is applied to the
partial product instead of to every weight).  int4 keeps two weights per byte (column ``2j``
low nibble, ``2j + 1`` high nibble): ``x`` is split into its even and odd columns outside the
kernel, so a packed tile's low nibbles meet the even half and its high nibbles the odd half
(no interleaving in the kernel).

The wrapper pads rows of ``x`` to ``BM`` and, only where they are not multiples, the
weight's rows to ``BN`` and the input features to ``BK`` (zeros: a padded feature meets a
zero of ``x``).  Scales and zero points go in as ``[G, N]`` so a step's are one row.

Lowering (Triton backend, as the other kernels here): power-of-two block shapes, whole-array
block specs with ``pl.ds`` slices inside, the ``pallas_call`` built inside the traced
wrapper.  On CPU it runs with ``interpret=True`` and is tested there against
:func:`quant_matmul_reference` (``tests/kernels/test_pallas_quant_matmul.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.formats.int_weights import QuantizedLinear, dequantize

_EXACT = jax.lax.Precision.HIGHEST
_DEFAULT_ZERO = {"int8": 0.0, "int4": 8.0, "fp8": 0.0}


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def supported(w: QuantizedLinear) -> bool:
    """Whether the kernel takes ``w`` on a GPU: a per-channel weight, or groups of a power of
    two of at least 32 (int4 splits a group into 16-wide halves: Triton's smallest dot)."""
    return w.num_groups == 1 or (_is_pow2(w.group_size) and w.group_size >= 32)


def _block_k(w: QuantizedLinear) -> int:
    if w.num_groups > 1:
        return w.group_size                       # one scale per output feature per step
    return min(256, pl.next_power_of_2(max(w.shape[1], 32)))


def _kernel(x_ref, w_ref, s_ref, *rest, fmt: str, bm: int, bn: int, bk: int, nk: int, grouped: bool,
            has_zero: bool):
    z_ref, o_ref = rest if has_zero else (None, rest[0])
    i, j = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * bn, bn)
    half = bk // 2

    def body(k, acc):
        g = k if grouped else 0
        s = s_ref[g, cols]                                               # [BN]
        z = z_ref[g, cols].astype(jnp.float32)[:, None] if has_zero else _DEFAULT_ZERO[fmt]  # [BN, 1]
        if fmt == "int4":
            wq = w_ref[cols, pl.ds(k * half, half)]                       # uint8 [BN, BK/2]
            lo = (wq & 0xF).astype(jnp.float32) - z
            hi = (wq >> 4).astype(jnp.float32) - z
            xe = x_ref[0, pl.ds(i * bm, bm), pl.ds(k * half, half)]       # [BM, BK/2] even columns
            xo = x_ref[1, pl.ds(i * bm, bm), pl.ds(k * half, half)]       # [BM, BK/2] odd columns
            part = (jnp.dot(xe, lo.T, preferred_element_type=jnp.float32, precision=_EXACT)
                    + jnp.dot(xo, hi.T, preferred_element_type=jnp.float32, precision=_EXACT))
        else:
            wt = w_ref[cols, pl.ds(k * bk, bk)].astype(jnp.float32)       # [BN, BK]
            if has_zero:
                wt = wt - z
            xt = x_ref[pl.ds(i * bm, bm), pl.ds(k * bk, bk)]              # [BM, BK]
            part = jnp.dot(xt, wt.T, preferred_element_type=jnp.float32, precision=_EXACT)
        return acc + part * s[None, :]                                    # [BM, BN]

    o_ref[...] = jax.lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.float32))


def _call(x, w: QuantizedLinear, *, block_m, block_n, interpret, num_warps, num_stages):
    M, K = x.shape
    N = w.shape[0]
    bk = _block_k(w)
    bm = block_m or min(64, max(16, pl.next_power_of_2(M)))
    bn = block_n or min(64, max(16, pl.next_power_of_2(N)))
    grouped = w.num_groups > 1
    nk = w.num_groups if grouped else -(-K // bk)
    Kp, Mp, Np = nk * bk, -(-M // bm) * bm, -(-N // bn) * bn

    x = jnp.pad(x.astype(jnp.float32), ((0, Mp - M), (0, Kp - K)))       # [Mp, Kp]
    q = w.q
    if w.format == "int4":
        x = jnp.stack([x[:, 0::2], x[:, 1::2]])                           # [2, Mp, Kp/2]
        q = jnp.pad(q, ((0, Np - N), (0, Kp // 2 - q.shape[1])))          # [Np, Kp/2]
    else:
        q = jnp.pad(q, ((0, Np - N), (0, Kp - K)))                        # [Np, Kp]
    s = jnp.pad(w.scale.astype(jnp.float32).T, ((0, 0), (0, Np - N)))     # [G, Np]
    args = [x, q, s]
    if w.zero is not None:
        args.append(jnp.pad(w.zero.T, ((0, 0), (0, Np - N))))             # [G, Np]

    kernel = functools.partial(_kernel, fmt=w.format, bm=bm, bn=bn, bk=bk, nk=nk, grouped=grouped,
                               has_zero=w.zero is not None)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # noqa: E731
    extra = {}
    if not interpret:
        extra["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    out = pl.pallas_call(
        kernel,
        grid=(Mp // bm, Np // bn),
        in_specs=[whole(a) for a in args],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((Mp, Np), jnp.float32),
        interpret=interpret,
        name=f"quant_matmul_{w.type_name.lower()}_bm{bm}_bn{bn}_bk{bk}",
        **extra,
    )(*args)
    return out[:M, :N]


def quant_matmul(x: jax.Array, w: QuantizedLinear, *, block_m: int | None = None, block_n: int | None = None,
                 interpret: bool | None = None, num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """x [M, in] (any float dtype) @ W[out, in]^T -> float32 [M, out], W read from ``w``'s
    quantized values.  ``interpret`` None: interpret mode on CPU."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x of shape {tuple(x.shape)} is not [M, {w.shape[1]}] for the {w.type_name} "
                         f"weight of shape {w.shape}")
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b is not None and not _is_pow2(b):
            raise ValueError(f"{name} must be a power of two, got {b}")
    if not interpret and not supported(w):
        raise ValueError(f"the Pallas quantized matmul takes groups of a power of two >= 32 on a GPU, not "
                         f"{w.group_size} ({w.type_name}); use jaxllm.formats.int_weights.matmul")
    return _call(x, w, block_m=block_m, block_n=block_n, interpret=interpret, num_warps=num_warps,
                 num_stages=num_stages)


quant_matmul_jit = jax.jit(quant_matmul, static_argnames=("block_m", "block_n", "interpret", "num_warps",
                                                          "num_stages"))
"""The jitted entry point."""


def quant_matmul_reference(x: jax.Array, w: QuantizedLinear) -> jax.Array:
    """Plain jnp: the weight dequantized whole, then a float32 dot -> float32 [M, out]."""
    return jax.lax.dot_general(x.astype(jnp.float32), dequantize(w), (((1,), (1,)), ((), ())),
                               precision=_EXACT, preferred_element_type=jnp.float32)

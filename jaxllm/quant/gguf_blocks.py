"""GGUF's 32-weight block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) as plain device arrays.

A GGUF tensor of such a type is rows of blocks, each block a few fields packed into
``type_size`` bytes (llama.cpp's ``ggml-common.h`` is the spec, ``gguf/quants.py`` the
numpy reading of it):

  ==== ======================================== ======= ===============
  type block fields, in file order              bytes   bits per weight
  ==== ======================================== ======= ===============
  Q8_0 d f16, qs int8[32]                       34      8.5
  Q4_0 d f16, qs u8[16]                         18      4.5
  Q4_1 d f16, m f16, qs u8[16]                  20      5.0
  Q5_0 d f16, qh u8[4], qs u8[16]               22      5.5
  Q5_1 d f16, m f16, qh u8[4], qs u8[16]        24      6.0
  ==== ======================================== ======= ===============

In the 4- and 5-bit types byte ``j`` of ``qs`` holds weight ``j`` in its low nibble and
weight ``j + 16`` in its high nibble; bit ``j`` of ``qh`` (read as a little-endian
uint32) is weight ``j``'s fifth bit.  A weight is ``d * q`` (``q`` signed: ``q - 8`` or
``q - 16``) or ``d * q + m``.

``pack`` splits the bytes into one array per field, so a kernel reads each field as a
whole array (no unaligned f16 loads out of a byte stream); every field keeps its file
width (scales stay float16 bits in uint16, quants stay packed), so the packed weight takes
exactly the file's bytes.  ``dequantize`` is the jnp inverse, equal bit for bit to
``gguf.quants.dequantize`` (``dequantize_reference``, the oracle).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

BLOCK_SIZE = 32

# type -> (has min m, has high bits qh, bytes of qs per block)
_LAYOUT = {
    "Q8_0": (False, False, 32),
    "Q4_0": (False, False, 16),
    "Q4_1": (True, False, 16),
    "Q5_0": (False, True, 16),
    "Q5_1": (True, True, 16),
}
SUPPORTED_TYPES = tuple(_LAYOUT)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedWeight:
    """A weight ``[out, in]`` as its GGUF block fields; ``nb = in // 32`` blocks per row."""

    d: jax.Array                 # [out, nb] uint16, float16 bits of the scale
    qs: jax.Array                # [out, nb, 32 | 16] uint8: int8 quants (Q8_0) or nibble pairs
    m: jax.Array | None = None   # [out, nb] uint16, float16 bits of the min (Q4_1, Q5_1)
    qh: jax.Array | None = None  # [out, nb, 4] uint8, the fifth bits, little-endian (Q5_*)
    type_name: str = field(default="", metadata=dict(static=True))
    shape: tuple[int, int] = field(default=(0, 0), metadata=dict(static=True))  # (out, in)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.d, self.qs, self.m, self.qh) if a is not None)


def _type_name(ggml_type) -> str:
    """The type's name for a GGMLQuantizationType, its int value or its name."""
    try:
        if isinstance(ggml_type, str):
            name = GGMLQuantizationType[ggml_type.upper()].name
        else:
            name = GGMLQuantizationType(ggml_type).name
    except (KeyError, ValueError):
        raise ValueError(f"unknown GGML type {ggml_type!r}") from None
    if name not in _LAYOUT:
        raise ValueError(f"GGML type {name} is not a supported packed type "
                         f"(supported: {', '.join(SUPPORTED_TYPES)})")
    return name


def _check_shape(name: str, shape) -> tuple[int, int]:
    if len(shape) != 2 or any(int(s) <= 0 for s in shape):
        raise ValueError(f"{name} weight shape {tuple(shape)} is not a 2-D [out, in] shape")
    n_out, n_in = int(shape[0]), int(shape[1])
    if n_in % BLOCK_SIZE:
        raise ValueError(f"{name} weight shape {tuple(shape)}: in={n_in} is not a multiple "
                         f"of the block size {BLOCK_SIZE}")
    return n_out, n_in


def pack(raw: np.ndarray, ggml_type, shape) -> PackedWeight:
    """Split a GGUF tensor's raw bytes (any uint8 view, e.g. ``GGUFTensor.data``) of a
    weight of logical ``shape = (out, in)`` into a ``PackedWeight`` of device arrays."""
    name = _type_name(ggml_type)
    n_out, n_in = _check_shape(name, shape)
    has_m, has_qh, qs_bytes = _LAYOUT[name]
    type_size = GGML_QUANT_SIZES[GGMLQuantizationType[name]][1]
    nb = n_in // BLOCK_SIZE
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if raw.size != n_out * nb * type_size:
        raise ValueError(f"{name} weight of shape ({n_out}, {n_in}) needs "
                         f"{n_out * nb * type_size} bytes, got {raw.size}")
    blocks = raw.reshape(n_out, nb, type_size)  # [out, nb, type_size]
    o = 0

    def take(n: int) -> np.ndarray:
        nonlocal o
        part = np.ascontiguousarray(blocks[:, :, o:o + n])
        o += n
        return part

    d = take(2).view(np.uint16)[..., 0]  # [out, nb]; GGUF is little-endian, as is the host
    m = take(2).view(np.uint16)[..., 0] if has_m else None
    qh = take(4) if has_qh else None     # [out, nb, 4]
    qs = take(qs_bytes)                   # [out, nb, qs_bytes]
    as_device = lambda a: None if a is None else jnp.asarray(a)
    return PackedWeight(d=as_device(d), qs=as_device(qs), m=as_device(m), qh=as_device(qh),
                        type_name=name, shape=(n_out, n_in))


def _f16_bits_to_f32(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _nibbles(qs: jax.Array) -> jax.Array:
    # [out, nb, 16] u8 -> [out, nb, 32] u8: low nibbles are weights 0..15, high 16..31
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: jax.Array) -> jax.Array:
    # [out, nb, 4] u8 -> [out, nb, 32] u8, weight j's bit = bit j % 8 of byte j // 8
    shifts = jnp.arange(8, dtype=jnp.uint8)
    bits = (qh[..., :, None] >> shifts) & 1  # [out, nb, 4, 8]
    return bits.reshape(*qh.shape[:-1], BLOCK_SIZE)


def dequantize(pw: PackedWeight) -> jax.Array:
    """The weight ``[out, in]`` float32, computed as gguf.quants does (bit for bit)."""
    n_out, n_in = pw.shape
    d = _f16_bits_to_f32(pw.d)[..., None]  # [out, nb, 1]
    if pw.type_name == "Q8_0":
        q = jax.lax.bitcast_convert_type(pw.qs, jnp.int8).astype(jnp.float32)
    elif pw.type_name in ("Q4_0", "Q4_1"):
        q = _nibbles(pw.qs)
    elif pw.type_name in ("Q5_0", "Q5_1"):
        q = _nibbles(pw.qs) | (_high_bits(pw.qh) << 4)
    else:
        raise ValueError(f"PackedWeight of unsupported type {pw.type_name!r}")
    if pw.type_name in ("Q4_0", "Q5_0"):
        # symmetric types: centre the unsigned quant on zero before scaling
        offset = 8 if pw.type_name == "Q4_0" else 16
        q = q.astype(jnp.int32) - offset
    w = d * q.astype(jnp.float32)  # [out, nb, 32]
    if pw.m is not None:
        w = w + _f16_bits_to_f32(pw.m)[..., None]
    return w.reshape(n_out, n_in)


def dequantize_reference(raw: np.ndarray, ggml_type, shape) -> np.ndarray:
    """The oracle: ``gguf.quants.dequantize`` of the raw bytes, as float32 ``[out, in]``."""
    from gguf.quants import dequantize as gguf_dequantize
    name = _type_name(ggml_type)
    n_out, n_in = _check_shape(name, shape)
    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(n_out, -1)
    return gguf_dequantize(rows, GGMLQuantizationType[name]).astype(np.float32).reshape(n_out, n_in)

"""GGUF's block formats as plain device arrays: the 32-weight types (Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1), the 256-weight K-quants (Q4_K, Q5_K, Q6_K) and 16-bit floats (F16, BF16).

A GGUF tensor of such a type is rows of blocks, each block a few fields packed into
``type_size`` bytes (llama.cpp's ``ggml-common.h`` is the spec, ``gguf/quants.py`` the
numpy reading of it):

  ==== ====================================================== ===== ===============
  type block fields, in file order                            bytes bits per weight
  ==== ====================================================== ===== ===============
  Q8_0 d f16, qs int8[32]                                     34    8.5
  Q4_0 d f16, qs u8[16]                                       18    4.5
  Q4_1 d f16, m f16, qs u8[16]                                20    5.0
  Q5_0 d f16, qh u8[4], qs u8[16]                             22    5.5
  Q5_1 d f16, m f16, qh u8[4], qs u8[16]                      24    6.0
  Q4_K d f16, dmin f16, scales u8[12], qs u8[128]             144   4.5
  Q5_K d f16, dmin f16, scales u8[12], qh u8[32], qs u8[128]  176   5.5
  Q6_K ql u8[128], qh u8[64], scales int8[16], d f16          210   6.5625
  F16  one float16                                            2     16
  BF16 one bfloat16                                           2     16
  ==== ====================================================== ===== ===============

In the 4- and 5-bit 32-weight types byte ``j`` of ``qs`` holds weight ``j`` in its low
nibble and weight ``j + 16`` in its high nibble; bit ``j`` of ``qh`` (read as a
little-endian uint32) is weight ``j``'s fifth bit.  A weight is ``d * q`` (``q`` signed:
``q - 8`` or ``q - 16``) or ``d * q + m``.

A K-quant super-block of 256 weights has sub-blocks with their own scale.  Q4_K and Q5_K:
8 sub-blocks of 32, sub-block ``i`` weight ``(d * sc_i) * q - dmin * m_i`` with 6-bit
``sc_i, m_i`` packed into the 12 ``scales`` bytes; byte ``j`` of the 32-byte group ``i // 2``
of ``qs`` holds sub-block ``i``'s weight ``j`` in its low (even ``i``) or high (odd ``i``)
nibble; Q5_K's fifth bit is bit ``i`` of ``qh[j]``.  Q6_K: 16 sub-blocks of 16, weight
``(d * scales_k) * (q - 32)`` with ``q``'s low 4 bits in ``ql`` and high 2 in ``qh``.

``pack`` splits the bytes into one array per field, so a kernel reads each field as a
whole array (no unaligned f16 loads out of a byte stream); every field keeps its file
width (scales stay float16 bits in uint16, the K-quants' 6-bit scales stay packed, quants
stay packed), so the packed weight takes exactly the file's bytes.  ``dequantize`` is the
jnp inverse, equal bit for bit to ``gguf.quants.dequantize`` (``dequantize_reference``,
the oracle).  F32 tensors are not a packed type: they load as plain arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import jax
import jax.numpy as jnp
import numpy as np

BLOCK_SIZE = 32  # weights per block of the 32-weight types
QK_K = 256       # weights per K-quant super-block

# type -> its block's fields in file order, (name, bytes); a 2-byte field is one
# 16-bit value per block (uint16), the others are byte arrays.
_FIELDS = {
    "Q8_0": (("d", 2), ("qs", 32)),
    "Q4_0": (("d", 2), ("qs", 16)),
    "Q4_1": (("d", 2), ("m", 2), ("qs", 16)),
    "Q5_0": (("d", 2), ("qh", 4), ("qs", 16)),
    "Q5_1": (("d", 2), ("m", 2), ("qh", 4), ("qs", 16)),
    "Q4_K": (("d", 2), ("dmin", 2), ("scales", 12), ("qs", QK_K // 2)),
    "Q5_K": (("d", 2), ("dmin", 2), ("scales", 12), ("qh", QK_K // 8), ("qs", QK_K // 2)),
    "Q6_K": (("ql", QK_K // 2), ("qh", QK_K // 4), ("scales", QK_K // 16), ("d", 2)),
    "F16": (("bits", 2),),
    "BF16": (("bits", 2),),
}
SUPPORTED_TYPES = tuple(_FIELDS)
# type -> (weights per block, bytes per block); the gguf package (gguf.constants) has the same
# table, but the engine imports this module whether or not it loads a GGUF
_SIZES = {name: (QK_K if name.endswith("_K") else 1 if name in ("F16", "BF16") else BLOCK_SIZE,
                 sum(n for _, n in fields)) for name, fields in _FIELDS.items()}
_SIGNED_BYTES = {("Q6_K", "scales")}  # int8 fields (Q8_0's qs is read as int8 in dequantize)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedWeight:
    """A weight ``[out, in]`` as its GGUF block fields; ``nb = in // block_size(type)``
    blocks per row.  Fields a type lacks are None (not pytree leaves)."""

    d: jax.Array | None = None       # [out, nb] uint16, float16 bits of the (super-)block scale
    qs: jax.Array | None = None      # [out, nb, 32 | 16 | 128] uint8: int8 quants (Q8_0) or nibble pairs
    m: jax.Array | None = None       # [out, nb] uint16, float16 bits of the min (Q4_1, Q5_1)
    qh: jax.Array | None = None      # [out, nb, 4 | 32 | 64] uint8, the high bits (Q5_*, Q6_K)
    dmin: jax.Array | None = None    # [out, nb] uint16, float16 bits of the min's scale (Q4_K, Q5_K)
    scales: jax.Array | None = None  # [out, nb, 12] uint8 packed 6-bit (Q4_K, Q5_K) | [out, nb, 16] int8 (Q6_K)
    ql: jax.Array | None = None      # [out, nb, 128] uint8, the low 4 bits (Q6_K)
    bits: jax.Array | None = None    # [out, in] uint16, the weight's float16 / bfloat16 bits
    type_name: str = field(default="", metadata=dict(static=True))
    shape: tuple[int, int] = field(default=(0, 0), metadata=dict(static=True))  # (out, in)
    # 16: d, m, qs hold groups of 16 rows interleaved for quant_dot.cc's VNNI kernel
    # (quant/native_matmul.interleave_rows); 0: row-major, the layout everything else reads.
    interleaved: int = field(default=0, metadata=dict(static=True))
    # How the 8-bit-activation backend multiplies this weight (quant/activations.py, by
    # projection): "" by int8-rounded activations; "split": twice, by x rounded and by its
    # remainder (native_matmul.linear_packed_split), about float32's accuracy.
    activations: str = field(default="", metadata=dict(static=True))

    @property
    def nbytes(self) -> int:
        arrays = (getattr(self, f.name) for f in fields(self) if not f.metadata.get("static"))
        return sum(int(a.nbytes) for a in arrays if a is not None)


def block_size(type_name: str) -> int:
    """Weights per block of a supported type (32, 256, or 1 for the 16-bit floats)."""
    return _SIZES[_type_name(type_name)][0]


def _type_name(ggml_type) -> str:
    """The type's name for a GGMLQuantizationType, its int value or its name."""
    if isinstance(ggml_type, str):
        name = ggml_type.upper()
    elif hasattr(ggml_type, "name"):          # a GGMLQuantizationType
        name = ggml_type.name
    else:
        from gguf.constants import GGMLQuantizationType   # optional at import: a missing gguf is named at load
        try:
            name = GGMLQuantizationType(ggml_type).name
        except ValueError:
            raise ValueError(f"unknown GGML type {ggml_type!r}") from None
    if name not in _FIELDS:
        raise ValueError(f"GGML type {name} is not a supported packed type "
                         f"(supported: {', '.join(SUPPORTED_TYPES)})")
    return name


def _check_shape(name: str, shape) -> tuple[int, int]:
    if len(shape) != 2 or any(int(s) <= 0 for s in shape):
        raise ValueError(f"{name} weight shape {tuple(shape)} is not a 2-D [out, in] shape")
    n_out, n_in = int(shape[0]), int(shape[1])
    size = _SIZES[name][0]
    if n_in % size:
        raise ValueError(f"{name} weight shape {tuple(shape)}: in={n_in} is not a multiple "
                         f"of the block size {size}")
    return n_out, n_in


def pack(raw: np.ndarray, ggml_type, shape) -> PackedWeight:
    """Split a GGUF tensor's raw bytes (any uint8 view, e.g. ``GGUFTensor.data``) of a
    weight of logical ``shape = (out, in)`` into a ``PackedWeight`` of host (numpy) arrays
    (``jax.device_put`` moves it; jnp functions take it as it is)."""
    name = _type_name(ggml_type)
    n_out, n_in = _check_shape(name, shape)
    size, type_size = _SIZES[name]
    nb = n_in // size
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if raw.size != n_out * nb * type_size:
        raise ValueError(f"{name} weight of shape ({n_out}, {n_in}) needs "
                         f"{n_out * nb * type_size} bytes, got {raw.size}")
    blocks = raw.reshape(n_out, nb, type_size)  # [out, nb, type_size]
    parts, o = {}, 0
    for fname, n in _FIELDS[name]:
        part = np.ascontiguousarray(blocks[:, :, o:o + n])  # [out, nb, n]
        o += n
        if n == 2:
            part = part.view(np.uint16)[..., 0]  # [out, nb]; GGUF is little-endian, as is the host
        elif (name, fname) in _SIGNED_BYTES:
            part = part.view(np.int8)
        parts[fname] = part
    return PackedWeight(**parts, type_name=name, shape=(n_out, n_in))


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


def _dequantize_32(pw: PackedWeight) -> jax.Array:
    d = _f16_bits_to_f32(pw.d)[..., None]  # [out, nb, 1]
    if pw.type_name == "Q8_0":
        q = jax.lax.bitcast_convert_type(pw.qs, jnp.int8).astype(jnp.float32)
    elif pw.type_name in ("Q4_0", "Q4_1"):
        q = _nibbles(pw.qs)
    else:
        q = _nibbles(pw.qs) | (_high_bits(pw.qh) << 4)
    if pw.type_name in ("Q4_0", "Q5_0"):
        # symmetric types: centre the unsigned quant on zero before scaling
        offset = 8 if pw.type_name == "Q4_0" else 16
        q = q.astype(jnp.int32) - offset
    w = d * q.astype(jnp.float32)  # [out, nb, 32]
    if pw.m is not None:
        w = w + _f16_bits_to_f32(pw.m)[..., None]
    return w


def _k_scale_min(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The 12 packed bytes -> 8 six-bit scales and 8 six-bit mins, [out, nb, 8] u8 each.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales and mins 4-7
    are the nibbles of bytes 8-11 with their top 2 bits in the spare bits of bytes 0-7."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)  # [out, nb, 3, 4]
    sc_lo, mn_lo, hi = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = jnp.concatenate([sc_lo & 0x3F, (hi & 0x0F) | ((sc_lo >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([mn_lo & 0x3F, (hi >> 4) | ((mn_lo >> 2) & 0x30)], axis=-1)
    return sc, mn


def _dequantize_q45_k(pw: PackedWeight) -> jax.Array:
    n_out, nb = pw.d.shape
    sc, mn = _k_scale_min(pw.scales)
    # the sub-block scale and min, rounded to float32 before the weight's product (as gguf)
    d = (_f16_bits_to_f32(pw.d)[..., None] * sc.astype(jnp.float32))[..., None]       # [out, nb, 8, 1]
    dm = (_f16_bits_to_f32(pw.dmin)[..., None] * mn.astype(jnp.float32))[..., None]   # [out, nb, 8, 1]
    nib = jnp.array([0, 4], dtype=jnp.uint8).reshape(2, 1)
    q = (pw.qs.reshape(n_out, nb, 4, 1, 32) >> nib) & 0x0F  # [out, nb, 4, 2, 32]
    q = q.reshape(n_out, nb, 8, 32)
    if pw.type_name == "Q5_K":
        bit = jnp.arange(8, dtype=jnp.uint8).reshape(8, 1)
        qh = (pw.qh.reshape(n_out, nb, 1, 32) >> bit) & 1  # [out, nb, 8, 32]
        q = q | (qh << 4)
    return d * q.astype(jnp.float32) - dm  # [out, nb, 8, 32]


def _dequantize_q6_k(pw: PackedWeight) -> jax.Array:
    n_out, nb = pw.d.shape
    d = (_f16_bits_to_f32(pw.d)[..., None] * pw.scales.astype(jnp.float32))[..., None]  # [out, nb, 16, 1]
    # ql: two 64-byte halves, each byte two nibbles -> 8 rows of 32 (half, nibble, byte // 32)
    nib = jnp.array([0, 4], dtype=jnp.uint8).reshape(2, 1)
    ql = ((pw.ql.reshape(n_out, nb, 2, 1, 64) >> nib) & 0x0F).reshape(n_out, nb, 8, 32)
    # qh: two 32-byte halves, each byte four 2-bit fields -> 8 rows of 32 (half, field)
    crumb = jnp.array([0, 2, 4, 6], dtype=jnp.uint8).reshape(4, 1)
    qh = ((pw.qh.reshape(n_out, nb, 2, 1, 32) >> crumb) & 0x03).reshape(n_out, nb, 8, 32)
    q = (ql | (qh << 4)).astype(jnp.int32) - 32  # [out, nb, 8, 32] in -32..31
    return d * q.reshape(n_out, nb, 16, 16).astype(jnp.float32)  # [out, nb, 16, 16]


def dequantize(pw: PackedWeight) -> jax.Array:
    """The weight ``[out, in]`` float32, computed as gguf.quants does (bit for bit)."""
    n_out, n_in = pw.shape
    name = pw.type_name
    if name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        w = _dequantize_32(pw)
    elif name in ("Q4_K", "Q5_K"):
        w = _dequantize_q45_k(pw)
    elif name == "Q6_K":
        w = _dequantize_q6_k(pw)
    elif name == "F16":
        w = _f16_bits_to_f32(pw.bits)
    elif name == "BF16":
        # a bfloat16 is the top half of a float32: shifting keeps every bit (NaN payloads too)
        w = jax.lax.bitcast_convert_type(pw.bits.astype(jnp.uint32) << 16, jnp.float32)
    else:
        raise ValueError(f"PackedWeight of unsupported type {name!r}")
    return w.reshape(n_out, n_in)


def dequantize_reference(raw: np.ndarray, ggml_type, shape) -> np.ndarray:
    """The oracle: ``gguf.quants.dequantize`` of the raw bytes, as float32 ``[out, in]``."""
    from gguf.quants import dequantize as gguf_dequantize   # optional (the tests' oracle)
    name = _type_name(ggml_type)
    n_out, n_in = _check_shape(name, shape)
    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(n_out, -1)
    from gguf.constants import GGMLQuantizationType
    return gguf_dequantize(rows, GGMLQuantizationType[name]).astype(np.float32).reshape(n_out, n_in)

"""Weight-only quantized linear weights as device arrays: int8, int4 and FP8 (e4m3) with
per-channel, grouped or per-tensor scales and an optional zero point.

One type, :class:`QuantizedLinear`, holds what the HF checkpoint formats vLLM serves
(compressed-tensors pack-quantized / naive-quantized / float-quantized, GPTQ, fine-grained
FP8) and the online ``--quantization int8|fp8`` store, in one device layout:

  ======= ======================================== =========================================
  format  ``q``                                    a weight ``w[o, i]``
  ======= ======================================== =========================================
  int8    int8 ``[out, in]``                       ``(q[o, i] - z[o, g]) * s[o, g]``
  int4    uint8 ``[out, ceil(in / 2)]``: column    ``(u[o, i] - z[o, g]) * s[o, g]``, ``u``
          ``2j`` in the low nibble, ``2j + 1`` in  the unsigned nibble 0..15, ``z`` 8 when
          the high one                             the weight has no zero point
  fp8     float8_e4m3fn ``[out, in]``              ``q[o, i] * s[o, g]``
  ======= ======================================== =========================================

with ``g = i // group_size``.  ``scale`` is float32 ``[out, G]``, ``G = ceil(in / group_size)``
(``group_size = in``: per channel, ``G = 1``); a per-tensor scale is stored broadcast to
``[out, 1]`` and a 2-D block scale (FP8's ``[out / 128, in / 128]``) with its rows repeated,
so that every field has the ``out`` rows first, as ``quant/ops.py`` requires (fusing q/k/v
with different per-tensor scales is then plain row concatenation).  ``zero`` (int8
``[out, G]``, in ``q``'s domain) is None for symmetric weights.  Bytes per weight: int4 0.5
(+ 4 / group_size for scales), int8 and fp8 1: a quarter / an eighth of float32.

``dequantize`` is the jnp inverse used by the XLA path (inside the step), and
``dequantize_reference`` a float64 numpy one written apart from it (the oracle).
``quantize_int8`` / ``quantize_fp8`` are the online per-channel quantizers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FORMATS = ("int8", "int4", "fp8")
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)   # 448
_Q_DTYPES = {"int8": np.dtype(np.int8), "int4": np.dtype(np.uint8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
_DEFAULT_ZERO = {"int8": 0, "int4": 8, "fp8": 0}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedLinear:
    """A weight ``[out, in]`` as quantized values, scales and an optional zero point (see the
    module docstring for the layout).  Leaves may carry a leading layer axis when stacked."""

    q: jax.Array                  # int8 [out, in] | uint8 [out, ceil(in/2)] (int4) | float8_e4m3fn [out, in]
    scale: jax.Array              # float32 [out, G]
    zero: jax.Array | None = None  # int8 [out, G], q's domain; None: symmetric
    format: str = field(default="int8", metadata=dict(static=True))
    group_size: int = field(default=0, metadata=dict(static=True))     # weights per scale along `in`
    shape: tuple[int, int] = field(default=(0, 0), metadata=dict(static=True))  # (out, in)

    @property
    def nbytes(self) -> int:
        arrays = (getattr(self, f.name) for f in fields(self) if not f.metadata.get("static"))
        return sum(int(a.nbytes) for a in arrays if a is not None)

    @property
    def num_groups(self) -> int:
        return -(-self.shape[1] // self.group_size)

    @property
    def type_name(self) -> str:
        """``INT4_G128``, ``INT8``, ``FP8_G128``: the load log's name (per channel: no suffix)."""
        g = "" if self.group_size >= self.shape[1] else f"_G{self.group_size}"
        return f"{self.format.upper()}{g}"


def make(q, scale, zero=None, *, format: str, group_size: int, shape) -> QuantizedLinear:
    """A checked :class:`QuantizedLinear` from host arrays (scale cast to float32; a zero point
    equal to the format's default everywhere is dropped)."""
    if format not in FORMATS:
        raise ValueError(f"quantized weight format {format!r} is not one of {', '.join(FORMATS)}")
    n_out, n_in = (int(s) for s in shape)
    group_size = int(group_size) or n_in
    if group_size <= 0:
        raise ValueError(f"group size {group_size} must be positive")
    group_size = min(group_size, n_in)
    if format == "int4" and group_size < n_in and group_size % 2:
        raise ValueError(f"int4 groups pack two weights per byte: group size {group_size} must be even")
    G = -(-n_in // group_size)
    q = np.asarray(q)
    want_q = (n_out, -(-n_in // 2) if format == "int4" else n_in)
    if q.dtype != _Q_DTYPES[format] or q.shape != want_q:
        raise ValueError(f"{format} weight of shape {(n_out, n_in)}: values must be {_Q_DTYPES[format]} "
                         f"{want_q}, got {q.dtype} {q.shape}")
    scale = np.asarray(scale, np.float32)
    if scale.shape != (n_out, G):
        raise ValueError(f"{format} weight of shape {(n_out, n_in)} with groups of {group_size}: scale must be "
                         f"[{n_out}, {G}], got {list(scale.shape)}")
    if zero is not None:
        zero = np.asarray(zero)
        if zero.shape != (n_out, G):
            raise ValueError(f"zero point must be [{n_out}, {G}], got {list(zero.shape)}")
        if format == "fp8":
            raise ValueError("an fp8 weight has no zero point")
        zero = zero.astype(np.int8)
        if np.all(zero == _DEFAULT_ZERO[format]):
            zero = None
    return QuantizedLinear(q=q, scale=scale, zero=zero, format=format, group_size=group_size,
                           shape=(n_out, n_in))


# ---------------------------------------------------------------- jnp (inside the step)

def values(w: QuantizedLinear) -> jax.Array:
    """The stored values as float32 [..., out, in] (int4: the unsigned nibbles 0..15)."""
    if w.format == "int4":
        lo, hi = w.q & 0xF, w.q >> 4                                  # [..., out, in/2] each
        v = jnp.stack([lo, hi], axis=-1).reshape(*w.q.shape[:-1], -1)  # [..., out, 2 * ceil(in/2)]
        return v[..., : w.shape[1]].astype(jnp.float32)
    return w.q.astype(jnp.float32)


def dequantize(w: QuantizedLinear) -> jax.Array:
    """float32 [..., out, in]: ``(q - zero) * scale`` per group.  Every product is one float32
    rounding of an exact small integer (or fp8 value) times the scale."""
    n_in, g, G = w.shape[1], w.group_size, w.num_groups
    v = values(w)                                                     # [..., out, in]
    lead = v.shape[:-1]
    v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, G * g - n_in)]).reshape(*lead, G, g)  # [..., out, G, g]
    if w.zero is not None:
        v = v - w.zero.astype(jnp.float32)[..., None]
    elif _DEFAULT_ZERO[w.format]:
        v = v - float(_DEFAULT_ZERO[w.format])
    v = v * w.scale[..., None]
    return v.reshape(*lead, G * g)[..., :n_in]


def take_rows(w: QuantizedLinear, ids: jax.Array) -> jax.Array:
    """Rows ``ids`` [T] -> float32 [T, in], only those rows decoded."""
    rows = QuantizedLinear(q=w.q[ids], scale=w.scale[ids], zero=None if w.zero is None else w.zero[ids],
                           format=w.format, group_size=w.group_size, shape=(ids.shape[0], w.shape[1]))
    return dequantize(rows)


def matmul(x: jax.Array, w: QuantizedLinear) -> jax.Array:
    """The XLA path: x [T, in] @ W^T -> float32 [T, out], W dequantized inside the step."""
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the {w.type_name} weight of shape {w.shape} "
                         f"takes {w.shape[1]}")
    return jax.lax.dot_general(x.astype(jnp.float32), dequantize(w), (((x.ndim - 1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


# ---------------------------------------------------------------- numpy float64 oracle

def dequantize_reference(w: QuantizedLinear) -> np.ndarray:
    """float64 [out, in], element by element from the definition (no jnp)."""
    n_out, n_in = w.shape
    q = np.asarray(w.q)
    if w.format == "int4":
        cols = np.arange(n_in)
        byte = q[:, cols // 2].astype(np.int64)
        v = np.where(cols % 2 == 0, byte & 15, byte >> 4).astype(np.float64)
    else:
        v = q.astype(np.float64)
    groups = np.arange(n_in) // w.group_size                          # [in]
    z = (np.full((n_out, w.num_groups), _DEFAULT_ZERO[w.format], np.float64) if w.zero is None
         else np.asarray(w.zero, np.float64))
    s = np.asarray(w.scale, np.float64)
    return (v - z[:, groups]) * s[:, groups]


def matmul_reference(x, w: QuantizedLinear) -> np.ndarray:
    return np.asarray(x, np.float64) @ dequantize_reference(w).T


# ---------------------------------------------------------------- online quantizers

def quantize_int8(w: np.ndarray) -> QuantizedLinear:
    """Per-channel symmetric int8: ``s = max|w_row| / 127``, ``q = round(w / s)``."""
    w = np.asarray(w, np.float32)
    s = np.abs(w).max(axis=1, keepdims=True) / 127.0                 # [out, 1]
    s = np.where(s > 0, s, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / s), -127, 127).astype(np.int8)
    return make(q, s, format="int8", group_size=w.shape[1], shape=w.shape)


def quantize_fp8(w: np.ndarray) -> QuantizedLinear:
    """Per-channel e4m3: ``s = max|w_row| / 448``, ``q = e4m3(w / s)`` (round to nearest even)."""
    w = np.asarray(w, np.float32)
    s = np.abs(w).max(axis=1, keepdims=True) / FP8_MAX                # [out, 1]
    s = np.where(s > 0, s, 1.0).astype(np.float32)
    q = np.clip(w / s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return make(q, s, format="fp8", group_size=w.shape[1], shape=w.shape)


ONLINE = {"int8": quantize_int8, "fp8": quantize_fp8}
"""``--quantization`` values that quantize a float checkpoint at load."""

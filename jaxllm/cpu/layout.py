"""The panel layout of weight matrices for the native CPU matmul (``linear.cc``).

A matrix ``w [N, K]`` (transformers' ``[out, in]``) keeps its shape and dtype but not its
element order: the first ``N // 16 * 16`` rows become panels of 16 output columns stored
k-major (panel ``p``'s 16 weights for input ``k`` are contiguous), the last ``N % 16`` rows
stay row-major after them.  The kernel then reads each panel as one sequential stream and
multiplies 16 columns by a broadcast ``x[m, k]`` per load, instead of reducing dot
products across vector lanes.  Inside a bf16 panel (uint16 bit patterns, see
formats/storage.py) the columns are interleaved so that the low halves of the eight 32-bit
lanes are columns 0..7 and the high halves 8..15: one shift and one mask widen them.

Weights are laid out once, on the host, when the runner places them (:func:`pack`); the
tied embedding is also the LM head, so its rows are read back from the layout by
:func:`take_rows` instead of keeping a second copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PANEL = 16
# Panel lane -> column within the panel, for bf16: lanes 2i and 2i + 1 (one 32-bit lane)
# hold columns i and 8 + i.
_BF16_COLUMNS = np.array([lane // 2 + 8 * (lane % 2) for lane in range(PANEL)])
# Column -> lane, its inverse.
_BF16_LANES = np.argsort(_BF16_COLUMNS)


def _is_bf16(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.uint16), jnp.dtype(jnp.bfloat16))


def _aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """``np.empty`` whose data starts on an ``align``-byte boundary: XLA:CPU's ``device_put``
    wraps such a buffer without a copy (a 16-byte aligned one is copied)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    offset = -raw.ctypes.data % align
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def _pack_into(w: np.ndarray, flat: np.ndarray) -> None:
    """Writes ``w [..., N, K]`` in the panel layout into ``flat [..., N * K]``."""
    *lead, N, K = w.shape
    P = N // PANEL
    head = w[..., :P * PANEL, :].reshape(*lead, P, PANEL, K)             # [..., P, 16 columns, K]
    if _is_bf16(w.dtype):
        head = head[..., _BF16_COLUMNS, :]                               # columns in lane order
    flat[..., :P * K * PANEL].reshape(*lead, P, K, PANEL)[...] = np.swapaxes(head, -1, -2)   # [..., P, K, 16 lanes]
    flat[..., P * K * PANEL:] = w[..., P * PANEL:, :].reshape(*lead, -1)


def pack(w: np.ndarray) -> np.ndarray:
    """``w [..., N, K]`` (float32, or bf16 as bfloat16 or uint16 bits) -> the same shape and
    dtype in the panel layout, for every leading index (stacked layers).  One pass into the
    result (a start-up lays out every weight), 64-byte aligned so that placing it on the CPU
    device aliases it instead of copying."""
    w = np.asarray(w)
    out = _aligned_empty(w.shape, w.dtype)
    _pack_into(w, out.reshape(*w.shape[:-2], -1))
    return out


def pack_rows(parts: list[np.ndarray]) -> np.ndarray:
    """``pack(np.concatenate(parts))`` for 2-D ``parts [N_i, K]`` (fused projections), in one
    pass: when every part but the last has whole panels (``N_i % 16 == 0``), the layout of the
    concatenation is the parts' layouts one after the other."""
    parts = [np.asarray(p) for p in parts]
    if len(parts) == 1:
        return pack(parts[0])
    if any(p.ndim != 2 for p in parts) or any(p.shape[0] % PANEL for p in parts[:-1]):
        return pack(np.concatenate(parts))
    out = _aligned_empty((sum(p.shape[0] for p in parts), parts[0].shape[1]), parts[0].dtype)
    flat, off = out.reshape(-1), 0
    for p in parts:
        _pack_into(p, flat[off:off + p.size])
        off += p.size
    return out


def unpack(wp: np.ndarray) -> np.ndarray:
    """The inverse of :func:`pack` (tests and debugging)."""
    wp = np.asarray(wp)
    *lead, N, K = wp.shape
    P = N // PANEL
    flat = wp.reshape(*lead, N * K)
    head = np.swapaxes(flat[..., :P * K * PANEL].reshape(*lead, P, K, PANEL), -1, -2)   # [..., P, 16 lanes, K]
    if _is_bf16(wp.dtype):
        head = head[..., _BF16_LANES, :]
    rows = np.concatenate([head.reshape(*lead, P * PANEL, K), flat[..., P * K * PANEL:].reshape(*lead, -1, K)], -2)
    return np.ascontiguousarray(rows)


def take_rows(wp: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows ``ids [T]`` of the matrix whose panel layout is ``wp [N, K]`` -> ``[T, K]`` in
    natural order (the embedding lookup on a tied embedding laid out as the LM head)."""
    N, K = wp.shape
    if N * K >= 2**31:
        raise ValueError(f"a {N}x{K} matrix is too large for 32-bit indexing in the panel layout")
    P = N // PANEL
    lanes = jnp.asarray(_BF16_LANES if _is_bf16(wp.dtype) else np.arange(PANEL), jnp.int32)
    ids = ids.astype(jnp.int32)[:, None]                                  # [T, 1]
    k = jnp.arange(K, dtype=jnp.int32)[None, :]                           # [1, K]
    in_panel = (ids // PANEL) * (K * PANEL) + k * PANEL + lanes[ids % PANEL]
    in_tail = P * PANEL * K + (ids - P * PANEL) * K + k
    return wp.reshape(-1)[jnp.where(ids < P * PANEL, in_panel, in_tail)]  # [T, K]

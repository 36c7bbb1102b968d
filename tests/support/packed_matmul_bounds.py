"""Error bounds of the native packed-block matmul (jaxllm/cpu/quant_linear.cc) against the
float64 reference: the largest float32 error the kernel's sums can make, in any order, per
output element.  Shared by the kernel tests and the K-quant fixture tests."""

from __future__ import annotations

import numpy as np


def _k_terms(pw) -> tuple[np.ndarray, np.ndarray]:
    """|sub-block scale * q| and |sub-block min| per weight, [N, K] float64 each, decoded here
    in numpy from the packed fields (the reference's layout, gguf_blocks.py's docstring)."""
    n, k = pw.shape
    nb = k // 256
    d = np.asarray(pw.d).view(np.float16).astype(np.float64)[..., None]  # [N, nb, 1]
    if pw.type_name == "Q6_K":
        sc = np.asarray(pw.scales).astype(np.float64)                     # [N, nb, 16]
        ql, qh = np.asarray(pw.ql), np.asarray(pw.qh)                       # [N, nb, 128], [N, nb, 64]
        q = np.empty((n, nb, 256))
        for h in range(2):
            for s in range(4):
                lo = (ql[..., 64 * h + 32 * (s % 2):][..., :32] >> (4 * (s // 2))) & 0x0F
                hi = (qh[..., 32 * h:32 * h + 32] >> (2 * s)) & 3
                q[..., 128 * h + 32 * s:][..., :32] = (lo | (hi << 4)).astype(np.float64) - 32
        ds = np.repeat(d * sc, 16, axis=-1)                               # [N, nb, 256]
        return np.abs(ds * q).reshape(n, k), np.zeros((n, k))
    b = np.asarray(pw.scales).astype(np.int64)                            # [N, nb, 12]
    sc = np.concatenate([b[..., 0:4] & 63, (b[..., 8:12] & 15) | ((b[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], axis=-1)
    dmin = np.asarray(pw.dmin).view(np.float16).astype(np.float64)[..., None]
    qs = np.asarray(pw.qs).reshape(n, nb, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, nb, 8, 32).astype(np.float64)
    if pw.qh is not None:
        bits = (np.asarray(pw.qh)[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [N, nb, 8, 32]
        q += 16 * bits
    ds, dm = (d * sc)[..., None], (dmin * mn)[..., None]                  # [N, nb, 8, 1]
    return np.abs(ds * q).reshape(n, k), np.broadcast_to(np.abs(dm), q.shape).reshape(n, k)


def bound_k(x: np.ndarray, pw) -> np.ndarray:
    """Largest float32 error of the K-quant kernel, for any order of its sums.

    Q4_K / Q5_K: y = sum over sub-blocks i of ds_i sum_j q_j x_j - dm_i sum_j x_j.  A term
    q_j x_j passes through at most 4 roundings in its sub-block's partial (a product and 3
    FMAs), then the accumulator's chain, 9 FMAs per super-block (8 scale FMAs and the one
    that subtracts the 8 min terms), at most 9 nb in all, then the 3 adds of the 8-lane sum:
    9 nb + 7.  A min term dm_i x_j: 2 adds in the lane sums, 3 in their horizontal sum, then
    the same chain: at most 9 nb + 3.  ds_i = d sc_i and dm_i are exact in float32 (an 11-bit
    significand times a 6-bit integer), so by Higham (Thm 3.1) the error against the exact
    sum is at most gamma_n sum_j (|ds q_j| + |dm|) |x_j|, n = 9 nb + 7, gamma_n = n u /
    (1 - n u), u = 2^-24.  The reference weight fl(ds q - dm) (ds q exact: 17 + 5 bits) is off
    by at most u (|ds q| + |dm|): one more u.
    Q6_K: a term passes through 2 roundings in its 16-weight partial, the accumulator's 16
    FMAs per super-block (16 nb), and the 3 adds: n = 16 nb + 5.  The reference weight
    (d sc) (q - 32) is exact in float32 (11 + 7 + 5 bits), so no extra u.
    The float64 product of the reference adds at most gamma_K in float64 (u64 = 2^-53).
    """
    nb = pw.shape[1] // 256
    scaled, mins = _k_terms(pw)
    u = 2.0 ** -24
    n, extra = (16 * nb + 5, 0.0) if pw.type_name == "Q6_K" else (9 * nb + 7, u)
    k64 = pw.shape[1] * 2.0 ** -53
    return (n * u / (1 - n * u) + extra + k64) * (np.abs(x.astype(np.float64)) @ (scaled + mins).T)


def bound_32(x: np.ndarray, pw) -> np.ndarray:
    """Largest float32 error of the kernel, for any order of its sums.

    The kernel computes sum_b (d_b sum_j q_j x_j + m_b sum_j x_j) in float32, with q the
    signed quant (Q4_0: q - 8, Q5_0: q - 16, subtracted in the integer bytes, so exact).
    Every term d q_j x_j and m x_j passes through at most nb + 12 <= K roundings (one
    product or FMA per vector of the block, the block scale's FMA, the accumulation over nb
    blocks, the 8- or 16-lane sum and the final add), so by Higham (Thm 3.1) the error against the
    exact sum is at most gamma_K sum_j (|d q_j| + |m|) |x_j|, gamma_n = n u / (1 - n u),
    u = 2^-24.  The reference's weight is d q (exact in float32: 11-bit d times a <= 8-bit
    q) for Q8_0, Q4_0 and Q5_0, and fl(d q + m) for Q4_1 and Q5_1, off the exact d q + m by
    at most u (|d q| + |m|): one more u.
    """
    d = np.asarray(pw.d).view(np.float16).astype(np.float64)[..., None]  # [N, nb, 1]
    qs = np.asarray(pw.qs)
    if pw.type_name == "Q8_0":
        q = qs.view(np.int8).astype(np.float64)  # [N, nb, 32]
    else:
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float64)  # [N, nb, 32]
    if pw.qh is not None:
        # bit j of the little-endian uint32 qh is weight j's fifth bit
        h = np.asarray(pw.qh).view("<u4")  # [N, nb, 1]
        q += ((h >> np.arange(32, dtype=np.uint32)) & 1).astype(np.float64) * 16
    q -= {"Q4_0": 8, "Q5_0": 16}.get(pw.type_name, 0)
    if pw.m is None:
        m, extra = 0.0, 0.0
    else:
        m, extra = np.asarray(pw.m).view(np.float16).astype(np.float64)[..., None], 2.0 ** -24
    mag = (np.abs(d * q) + np.abs(m)).reshape(pw.shape)  # [N, K]
    n, u = pw.shape[1], 2.0 ** -24
    return (n * u / (1 - n * u) + extra) * (np.abs(x.astype(np.float64)) @ mag.T)


def bound(x: np.ndarray, pw) -> np.ndarray:
    """``bound_k`` or ``bound_32``, by the block size of ``pw``'s type."""
    return bound_k(x, pw) if pw.type_name.endswith("_K") else bound_32(x, pw)

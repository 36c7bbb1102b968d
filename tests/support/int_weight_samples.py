"""Random packed integer / fp8 weights (``jaxllm/formats/int_weights.py``) for the kernel and
format tests."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jaxllm.formats import int_weights as iw


def random_weight(rng, fmt, N, K, group, zero, per_tensor=False):
    G = -(-K // group)
    if fmt == "int4":
        u = rng.integers(0, 16, (N, K + K % 2))
        q = (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)
    elif fmt == "int8":
        q = rng.integers(-128, 128, (N, K)).astype(np.int8)
    else:
        q = (rng.standard_normal((N, K)) * 50).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(0.01, 0.1, (1 if per_tensor else N, G)).astype(np.float32)
    s = np.broadcast_to(s, (N, G))
    z = rng.integers(0, 16, (N, G)) if zero else None
    return iw.make(q, s, z, format=fmt, group_size=group, shape=(N, K))

"""Random inputs for the gated delta rule and the tolerance its tests share (the XLA forms in
tests/layers/test_gated_delta.py, the Pallas kernel in tests/kernels/test_pallas_gated_delta.py)."""

from __future__ import annotations

import numpy as np

# float32 JAX against the float64 reference on values of magnitude ~1 (measured errors ~1e-6).
TOL = dict(atol=2e-5, rtol=2e-5)


def random_inputs(seed, B=2, T=37, Hk=2, H=4, Dk=8, Dv=6):
    """q, k [B, T, Hk, Dk], v [B, T, H, Dv], g, beta [B, T, H], state [B, H, Dk, Dv] float32,
    g as the model makes it: -exp(A_log) * softplus(a + dt_bias)."""
    r = np.random.default_rng(seed)
    q = r.standard_normal((B, T, Hk, Dk)).astype(np.float32)
    k = r.standard_normal((B, T, Hk, Dk)).astype(np.float32)
    v = r.standard_normal((B, T, H, Dv)).astype(np.float32)
    A = r.uniform(0.01, 4.0, H).astype(np.float32)
    a = r.standard_normal((B, T, H)).astype(np.float32)
    g = (-A * np.log1p(np.exp(a + 1.0))).astype(np.float32)
    beta = (1 / (1 + np.exp(-r.standard_normal((B, T, H))))).astype(np.float32)
    state = r.standard_normal((B, H, Dk, Dv)).astype(np.float32) * 0.5
    return q, k, v, g, beta, state

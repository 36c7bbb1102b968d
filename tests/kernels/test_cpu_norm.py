"""The native CPU RMSNorm (``jaxllm/cpu/norm.cc``) against layers/norm.py's XLA path, and the
property it exists for: a row's result does not depend on how many rows the call has or
where the row sits among them (XLA's does: see norm.cc)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.cpu import native
from jaxllm.layers.norm import rms_norm

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="native CPU kernels unavailable here (not a CPU backend, no AVX2/FMA, or no "
                                       "C++ compiler: the reason is in the jaxllm.cpu log)")


@pytest.mark.parametrize("d", [576, 64, 100, 7])   # hidden, a head, a tail past the 8 lanes, under 8
def test_native_rms_norm_equals_the_xla_norm(d):
    rng = np.random.default_rng(d)
    x = (rng.standard_normal((9, d)) * 3).astype(np.float32)
    x[0, :3] *= 100   # an outlier row
    w = rng.standard_normal(d).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, w: rms_norm(x, w, 1e-5, native=True))(x, w))
    ref = (w * (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5))).astype(np.float64)
    xla = np.asarray(jax.jit(lambda x, w: rms_norm(x, w, 1e-5))(x, w))
    # float32 sums of d squares: a few ulps of the float64 result
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-6 * np.abs(ref).max())
    np.testing.assert_allclose(got, xla, rtol=2e-6, atol=1e-6 * np.abs(ref).max())
    x3 = x[:8].reshape(2, 4, d)    # [..., D]: leading dims flattened and restored
    np.testing.assert_array_equal(np.asarray(rms_norm(jnp.asarray(x3), jnp.asarray(w), 1e-5, native=True)),
                                  got[:8].reshape(2, 4, d))


def test_a_rows_norm_is_the_same_bits_in_every_call_shape():
    rng = np.random.default_rng(0)
    X = (rng.standard_normal((40, 576)) * 3).astype(np.float32)
    w = jnp.asarray(rng.standard_normal(576), jnp.float32)
    f = jax.jit(lambda x: rms_norm(x, w, 1e-5, native=True))
    want = np.asarray(f(X[:1]))[0]
    for T in (2, 5, 8, 13, 16, 40):
        for j in (0, T // 2, T - 1):
            x = X[:T].copy()
            x[j] = X[0]
            np.testing.assert_array_equal(np.asarray(f(x))[j], want, err_msg=f"row {j} of {T}")

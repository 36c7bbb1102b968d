"""The native CPU matmul (jaxllm/cpu/linear.cc) against float64 numpy, on every tile-edge case."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxllm.cpu import native

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="native CPU kernel unavailable here (no AVX2/FMA or no C++ compiler)")

SHAPES = [(1, 8, 1), (1, 576, 1536), (2, 64, 5), (3, 67, 12), (4, 576, 49), (5, 13, 100), (7, 576, 576),
          (8, 1536, 576), (13, 64, 1537), (32, 576, 192), (37, 200, 97)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_matches_float64_reference(M, K, N, dtype):
    rng = np.random.default_rng(M * 1000 + K + N)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    if dtype == "bfloat16":
        w = w.astype(ml_dtypes.bfloat16)
    out = np.asarray(jax.jit(native.linear)(jnp.asarray(x), jnp.asarray(w)))
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert out.shape == (M, N) and out.dtype == np.float32
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < 1e-5, f"max relative error {err:.2e}"


def test_engine_uses_the_native_kernel_on_cpu(tiny_llm):
    # The default (--cpu-matmul auto) must pick the kernel where it is available; silently
    # falling back to XLA would only show up as a slow benchmark.
    assert tiny_llm.llm_engine.core.resolved.matmul_backend == "native"
    assert "jaxllm_linear" in tiny_llm.llm_engine.core.runner._compiled[(1, 1)].as_text()

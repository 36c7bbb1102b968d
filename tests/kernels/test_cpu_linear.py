"""The native CPU matmul (jaxllm/cpu/linear.cc) against float64 numpy, on every tile-edge case,
and the panel layout it reads (jaxllm/cpu/layout.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxllm.cpu import layout, native

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="native CPU kernel unavailable here (no AVX2/FMA or no C++ compiler)")

# Rows of x: every tile height 1-6 and uneven splits into tiles (13 = 5 + 4 + 4, 37 = 7 tiles),
# one L2 block of x and several (1000 rows of K = 200: 3 blocks of 324 and a rest); columns:
# whole panels, panels plus plain tail rows, tail rows alone; odd K for the k-loop remainders.
SHAPES = [(1, 8, 1), (1, 576, 1536), (2, 64, 5), (3, 67, 12), (4, 576, 49), (5, 13, 100), (6, 33, 48),
          (7, 576, 576), (8, 1536, 576), (13, 64, 1537), (32, 576, 192), (37, 200, 97), (1000, 200, 40)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_matches_float64_reference(M, K, N, dtype):
    rng = np.random.default_rng(M * 1000 + K + N)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    if dtype == "bfloat16":
        w = w.astype(ml_dtypes.bfloat16)
    out = np.asarray(jax.jit(native.linear)(jnp.asarray(x), jnp.asarray(layout.pack(w))))
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert out.shape == (M, N) and out.dtype == np.float32
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < 1e-5, f"max relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.uint16])
@pytest.mark.parametrize("N", [1, 16, 37, 64])
def test_layout_round_trip_and_row_lookup(N, dtype):
    rng = np.random.default_rng(N)
    w = rng.standard_normal((3, N, 24)).astype(np.float32).astype(dtype)   # stacked: per leading index
    wp = layout.pack(w)
    assert wp.shape == w.shape and wp.dtype == w.dtype
    if N >= 16:
        assert not np.array_equal(wp, w)   # the layout really moves elements
    np.testing.assert_array_equal(layout.unpack(wp), w)
    ids = rng.integers(0, N, size=9)
    rows = np.asarray(jax.jit(layout.take_rows)(jnp.asarray(wp[1]), jnp.asarray(ids)))
    np.testing.assert_array_equal(rows, w[1][ids])


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("rows", [(32, 16, 48), (576, 192, 192), (16, 37), (20, 16), (37,)],
                         ids=["whole-panels", "smollm2-qkv", "tail-last", "tail-first", "one"])
def test_fused_parts_are_laid_out_as_their_concatenation(rows, dtype):
    """pack_rows (fused q/k/v and gate/up, one pass) = pack of the concatenated rows, aligned
    so that the CPU device can alias it."""
    rng = np.random.default_rng(len(rows))
    parts = [rng.standard_normal((n, 24)).astype(np.float32).astype(dtype) for n in rows]
    packed = layout.pack_rows(parts)
    np.testing.assert_array_equal(packed, layout.pack(np.concatenate(parts)))
    assert packed.ctypes.data % 64 == 0


def test_engine_uses_the_native_kernel_on_cpu(tiny_llm):
    # The default (--cpu-matmul auto) must pick the kernel where it is available; silently
    # falling back to XLA would only show up as a slow benchmark.
    assert tiny_llm.llm_engine.core.resolved.step.kernels.matmul == "native"
    assert "jaxllm_linear" in tiny_llm.llm_engine.core.runner.compiler.steps[(1, 1)].compiled.as_text()

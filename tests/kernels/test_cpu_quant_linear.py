"""The native CPU matmul over packed GGUF blocks (jaxllm/cpu/quant_linear.cc) against the
float64 reference of the dequantized weight, on the built-in model's shapes and tile edges."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize

from jaxllm.cpu import native
from jaxllm.quant import matmul_reference, pack
from jaxllm.quant.native_matmul import NATIVE_TYPES, linear_packed

# (N, K): the built-in model's q/o, k/v, gate/up and down projections, and a small odd one
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (7, 96)]
# rows of x: batch 1, tile heights 3 and 4 + 3, a tile split 4 + 2, and a prefill chunk
ROWS = [1, 3, 6, 7, 32]

_linear_jit = jax.jit(linear_packed)


@pytest.fixture
def kernel():
    if not native.quant_available():
        pytest.skip("native packed-block matmul unavailable here: not a CPU backend, the CPU "
                    "lacks AVX2/FMA/F16C, or no C++ compiler (reason in the jaxllm.cpu log)")


def _quantized(type_name: str, shape, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * 0.05
    return quantize(w, GGMLQuantizationType[type_name])  # [N, K/32 * type_size] u8


def _bound(x: np.ndarray, pw) -> np.ndarray:
    """Largest float32 error of the kernel, for any order of its sums.

    The kernel computes sum_b (d_b sum_j q_j x_j + m_b sum_j x_j) in float32, with q the
    signed quant (Q4_0: q - 8, Q5_0: q - 16, subtracted in the integer bytes, so exact).
    Every term d q_j x_j and m x_j passes through at most nb + 12 <= K roundings (one
    product or FMA per vector of the block, the block scale's FMA, the accumulation over nb
    blocks, the 8-lane sum and the final add), so by Higham (Thm 3.1) the error against the
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


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("type_name", NATIVE_TYPES)
def test_matches_float64_reference(kernel, type_name, shape, M):
    seed = SHAPES.index(shape) * 10 + ROWS.index(M)
    raw = _quantized(type_name, shape, seed)
    pw = pack(raw, type_name, shape)
    x = np.random.default_rng(seed + 1).standard_normal((M, shape[1]), dtype=np.float32)
    got = np.asarray(_linear_jit(jnp.asarray(x), pw))
    want = matmul_reference(x, raw, type_name, shape)
    assert got.shape == want.shape == (M, shape[0]) and got.dtype == np.float32
    err = np.abs(got - want)
    bound = _bound(x, pw)
    assert np.all(err <= bound), f"worst error / bound {np.max(err / bound):.3f}"


@pytest.mark.parametrize("type_name", NATIVE_TYPES)
def test_composes_with_other_ops_under_jit(kernel, type_name):
    """Two kernel calls and elementwise ops in one jitted function: the FFI results feed
    further ops and each other like any XLA value."""
    shape1, shape2 = (192, 576), (576, 192)
    raw1, raw2 = _quantized(type_name, shape1, 7), _quantized(type_name, shape2, 8)
    pw1, pw2 = pack(raw1, type_name, shape1), pack(raw2, type_name, shape2)

    @jax.jit
    def step(x, pw1, pw2):
        h = jnp.tanh(linear_packed(x * 2.0, pw1))        # [M, 192]
        return linear_packed(h, pw2) + x                 # [M, 576]

    x = np.random.default_rng(9).standard_normal((3, 576), dtype=np.float32)
    got = np.asarray(step(jnp.asarray(x), pw1, pw2))
    h = np.tanh(matmul_reference(x * 2.0, raw1, type_name, shape1))
    want = matmul_reference(h, raw2, type_name, shape2) + x
    assert got.shape == (3, 576)
    # tanh and the propagated first-layer error make this an agreement check, not a bound
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_unsupported_type_and_shape_raise():
    pw = pack(np.zeros((4, 144), np.uint8), "Q4_K", (4, 256))   # one 144-byte super-block a row
    with pytest.raises(ValueError, match="no native CPU kernel for Q4_K"):
        linear_packed(jnp.zeros((1, 256)), pw)
    pw = pack(_quantized("Q8_0", (4, 64), 0), "Q8_0", (4, 64))
    with pytest.raises(ValueError, match=r"not \[M, 64\]"):
        linear_packed(jnp.zeros((1, 96)), pw)


def test_a_failed_build_leaves_the_other_kernels_on(monkeypatch, caplog):
    had_native = native.available()
    monkeypatch.setattr(native, "_quant_state", {})
    monkeypatch.setattr(native, "_QUANT_SOURCE", "no_such_kernel.cc")
    with caplog.at_level("WARNING", logger="jaxllm.cpu"):
        assert native.quant_available() is False
    assert "packed-block matmul unavailable" in caplog.text
    assert native.available() is had_native
    with pytest.raises(RuntimeError, match="unavailable"):
        linear_packed(jnp.zeros((1, 64)), pack(_quantized("Q8_0", (4, 64), 0), "Q8_0", (4, 64)))

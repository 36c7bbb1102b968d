"""The native CPU matmul over packed GGUF blocks (jaxllm/cpu/quant_linear.cc) against the
float64 reference of the dequantized weight, on the built-in model's shapes and tile edges.

The 32-weight types are quantized from random weights by ``gguf.quants.quantize``; it
cannot quantize the K-quants (NotImplementedError), so their super-blocks are random bytes
with finite f16 scales: every byte pattern is a valid block, and ``gguf.quants.dequantize``
of the bytes defines the truth either way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize
from support.packed_matmul_bounds import bound_32, bound_k

from jaxllm.cpu import native
from jaxllm.quant import PackedWeight, block_size, matmul_reference, pack
from jaxllm.quant.native_matmul import NATIVE_TYPES, linear_packed

TYPES_32 = [t for t in NATIVE_TYPES if block_size(t) == 32]
TYPES_K = [t for t in NATIVE_TYPES if block_size(t) == 256]

# (N, K): the built-in model's q/o, k/v, gate/up and down projections, and a small odd one
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (7, 96)]
# rows of x: batch 1, tile heights 3 and 4 + 3, a tile split 4 + 2, and a prefill chunk
ROWS = [1, 3, 6, 7, 32]

# K-quants (K a multiple of 256): the built-in model's down projection, a weight row count
# under one thread part (N < 8), one whose last thread part is short (65 = 8 parts of 9 but
# the last 2), and 5 super-blocks a row
SHAPES_K = [(576, 1536), (7, 256), (65, 512), (24, 1280)]
# rows of x: batch 1, tiles of 2 and 3, 5 = 3 + 2, 17 = 4 x 3 + 5 (tiles of 4 and 3), a prefill chunk
ROWS_K = [1, 2, 3, 5, 17, 64]

_linear_jit = jax.jit(linear_packed)


@pytest.fixture
def kernel():
    if not native.quant_available():
        pytest.skip("native packed-block matmul unavailable here: not a CPU backend, the CPU "
                    "lacks AVX2/FMA/F16C, or no C++ compiler (reason in the jaxllm.cpu log)")


@pytest.fixture(params=["avx512", "avx2"])
def isa(request, kernel):
    """The two tile paths of the 32-weight types and the K-quants, chosen at run time
    (AVX-512 where the CPU has it, the 8-lane AVX2 tiles otherwise): each test runs on both."""
    got = native.set_quant_avx512(request.param == "avx512")
    if request.param == "avx512" and not got:
        pytest.skip("the CPU lacks AVX512F/BW: only the AVX2 tiles can run here")
    yield request.param
    native.set_quant_avx512(True)


def _quantized(type_name: str, shape, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * 0.05
    return quantize(w, GGMLQuantizationType[type_name])  # [N, K/32 * type_size] u8


def _random_k_blocks(type_name: str, shape, seed: int) -> np.ndarray:
    """Random valid K-quant super-blocks [N, K/256 * type_size] u8: random quants and sub-block
    scales, and d (and dmin) finite f16 of random sign, |.| in [0.5, 1.5) * 1e-3."""
    rng = np.random.default_rng(seed)
    n, k = shape
    size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (n, k // size, type_size), dtype=np.uint8)  # [N, nb, type_size]

    def f16():
        v = rng.uniform(0.5, 1.5, (n, k // size)) * rng.choice([-1.0, 1.0], (n, k // size)) * 1e-3
        return v.astype(np.float16).view(np.uint8).reshape(n, k // size, 2)

    if type_name == "Q6_K":
        raw[..., -2:] = f16()                     # d is the block's last field
    else:
        raw[..., 0:2], raw[..., 2:4] = f16(), f16()   # d, dmin
    return raw.reshape(n, -1)


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("type_name", TYPES_32)
def test_matches_float64_reference(isa, type_name, shape, M):
    seed = SHAPES.index(shape) * 10 + ROWS.index(M)
    raw = _quantized(type_name, shape, seed)
    pw = pack(raw, type_name, shape)
    x = np.random.default_rng(seed + 1).standard_normal((M, shape[1]), dtype=np.float32)
    got = np.asarray(_linear_jit(jnp.asarray(x), pw))
    want = matmul_reference(x, raw, type_name, shape)
    assert got.shape == want.shape == (M, shape[0]) and got.dtype == np.float32
    err = np.abs(got - want)
    bound = bound_32(x, pw)
    assert np.all(err <= bound), f"worst error / bound {np.max(err / bound):.3f}"


@pytest.mark.parametrize("M", ROWS_K)
@pytest.mark.parametrize("shape", SHAPES_K, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("type_name", TYPES_K)
def test_k_quants_match_float64_reference(isa, type_name, shape, M):
    seed = 100 + SHAPES_K.index(shape) * 10 + ROWS_K.index(M)
    raw = _random_k_blocks(type_name, shape, seed)
    pw = pack(raw, type_name, shape)
    x = np.random.default_rng(seed + 1).standard_normal((M, shape[1]), dtype=np.float32)
    got = np.asarray(_linear_jit(jnp.asarray(x), pw))
    want = matmul_reference(x, raw, type_name, shape)
    assert got.shape == want.shape == (M, shape[0]) and got.dtype == np.float32
    err = np.abs(got - want)
    bound = bound_k(x, pw)
    assert np.all(err <= bound), f"worst error / bound {np.max(err / bound):.3f}"


@pytest.mark.parametrize("type_name", TYPES_32)
def test_a_row_is_the_same_bits_whatever_rows_share_the_call(isa, type_name):
    """A row of x gives the same bits alone (M = 1, the decode path), in a tile of 3, and in a
    call of 32 (other tiles of x, other thread parts, weight rows in other groups): the
    engine's guarantee that a token's logits do not depend on its batch or chunk."""
    shape = (1536, 576)
    pw = pack(_quantized(type_name, shape, 31), type_name, shape)
    x = np.random.default_rng(32).standard_normal((32, shape[1]), dtype=np.float32)
    full = np.asarray(_linear_jit(jnp.asarray(x), pw))                       # [32, N]
    for r in (0, 5, 31):
        alone = np.asarray(_linear_jit(jnp.asarray(x[r:r + 1]), pw))         # [1, N]
        np.testing.assert_array_equal(alone[0], full[r], err_msg=f"row {r}: M=1 vs M=32")
    three = np.asarray(_linear_jit(jnp.asarray(x[4:7]), pw))                 # [3, N]
    np.testing.assert_array_equal(three, full[4:7], err_msg="rows 4..6: M=3 vs M=32")


@pytest.mark.parametrize("K", [1536, 608])
def test_q4_1_prefill_panels_give_the_decode_paths_bits(isa, K):
    """From 32 rows of x, Q4_1 widens each thread part's weights once into float32 panels
    (quant_linear.cc, linear_q4_1_panels): a row's result must stay the 1-row
    call's bits.  The down projection's K = 1536 (48 blocks: three chunks of d and m on
    AVX-512, six on AVX2) and K = 608 (19 blocks: a short last chunk on both), 37 rows
    (tiles of 4 and a 1-row tail) and 1163 weight rows (on two threads, parts of 73 rows:
    a panel of 64 and one of 9, whose last pass is short)."""
    shape = (1163, K)
    raw = _quantized("Q4_1", shape, 41)
    pw = pack(raw, "Q4_1", shape)
    x = np.random.default_rng(42).standard_normal((37, shape[1]), dtype=np.float32)
    full = np.asarray(_linear_jit(jnp.asarray(x), pw))                       # [37, N]
    np.testing.assert_array_less(np.abs(full - matmul_reference(x, raw, "Q4_1", shape)), bound_32(x, pw))
    for r in (0, 17, 36):
        alone = np.asarray(_linear_jit(jnp.asarray(x[r:r + 1]), pw))         # [1, N]
        np.testing.assert_array_equal(alone[0], full[r], err_msg=f"row {r}: M=1 vs M=37")


def _weight(type_name: str, shape, seed: int) -> np.ndarray:
    if block_size(type_name) == 256:
        return _random_k_blocks(type_name, shape, seed)
    return _quantized(type_name, shape, seed)


@pytest.mark.parametrize("type_name", NATIVE_TYPES)
def test_composes_with_other_ops_under_jit(isa, type_name):
    """Two kernel calls and elementwise ops in one jitted function: the FFI results feed
    further ops and each other like any XLA value."""
    shape1, shape2 = ((192, 576), (576, 192)) if block_size(type_name) == 32 else ((256, 512), (512, 256))
    raw1, raw2 = _weight(type_name, shape1, 7), _weight(type_name, shape2, 8)
    pw1, pw2 = pack(raw1, type_name, shape1), pack(raw2, type_name, shape2)

    @jax.jit
    def step(x, pw1, pw2):
        h = jnp.tanh(linear_packed(x * 2.0, pw1))        # [M, 192]
        return linear_packed(h, pw2) + x                 # [M, 576]

    x = np.random.default_rng(9).standard_normal((3, shape1[1]), dtype=np.float32)
    got = np.asarray(step(jnp.asarray(x), pw1, pw2))
    h = np.tanh(matmul_reference(x * 2.0, raw1, type_name, shape1))
    want = matmul_reference(h, raw2, type_name, shape2) + x
    assert got.shape == (3, shape1[1])
    # tanh and the propagated first-layer error make this an agreement check, not a bound
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_unsupported_type_and_shape_raise():
    pw = PackedWeight(bits=np.zeros((4, 256), np.uint16), shape=(4, 256))   # no type
    with pytest.raises(ValueError, match="no native CPU kernel for untyped"):
        linear_packed(jnp.zeros((1, 256)), pw)
    pw = pack(_quantized("Q8_0", (4, 64), 0), "Q8_0", (4, 64))
    with pytest.raises(ValueError, match=r"not \[M, 64\]"):
        linear_packed(jnp.zeros((1, 96)), pw)


@pytest.mark.parametrize("type_name, field, bad", [("Q4_K", "scales", 11), ("Q5_K", "qh", 16),
                                                   ("Q6_K", "scales", 12)])
def test_k_field_of_the_wrong_shape_is_refused_by_the_kernel(kernel, type_name, field, bad):
    """A hand-made PackedWeight whose field does not match its shape: the target names it
    instead of reading past the array."""
    pw = pack(_random_k_blocks(type_name, (8, 512), 0), type_name, (8, 512))
    pw = PackedWeight(**{**{f: getattr(pw, f) for f in ("d", "qs", "qh", "dmin", "scales", "ql")},
                         field: getattr(pw, field)[..., :bad]}, type_name=type_name, shape=pw.shape)
    with pytest.raises(Exception, match=rf"jaxllm_linear_{type_name.lower()}: .*{field}\[N, K/256"):
        np.asarray(linear_packed(jnp.zeros((1, 512)), pw))


def test_a_failed_build_leaves_the_other_kernels_on(monkeypatch, caplog):
    had_native = native.available()
    monkeypatch.setattr(native, "_quant_state", {})
    monkeypatch.setattr(native, "_QUANT_KERNELS", {"no_such_kernel.cc": {"jaxllm_linear_q8_0": "JaxllmLinearQ8_0"}})
    with caplog.at_level("WARNING", logger="jaxllm.cpu"):
        assert native.quant_available() is False
    assert "packed-block matmul unavailable" in caplog.text
    assert native.available() is had_native
    with pytest.raises(RuntimeError, match="unavailable"):
        linear_packed(jnp.zeros((1, 64)), pack(_quantized("Q8_0", (4, 64), 0), "Q8_0", (4, 64)))


@pytest.mark.parametrize("type_name", ["F16", "BF16"])
@pytest.mark.parametrize("shape", [(576, 576), (37, 100), (9, 8), (5, 3)])
def test_16_bit_floats_match_float64_reference(kernel, type_name, shape):
    """F16 / BF16 GGUF matrices, read from their bits row by row (8 a load, K % 8 tail
    weights one at a time).  The weights are exact in float32, so the only error is the
    float32 sum of K products: at most K * 2^-24 (+1 for the product) * sum |x w|."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[type_name])
    pw = jax.device_put(pack(raw, type_name, shape))
    wd = np.abs(matmul_reference(np.eye(shape[1]), raw, type_name, shape)).T   # |W| [N, K]
    for M in ROWS:
        x = rng.standard_normal((M, shape[1])).astype(np.float32)
        y = np.asarray(_linear_jit(x, pw), np.float64)
        ref = matmul_reference(x, raw, type_name, shape)
        tol = (shape[1] + 1) * 2.0 ** -24 * (np.abs(x).astype(np.float64) @ wd.T) + 1e-30
        err = np.abs(y - ref)
        assert (err <= tol).all(), f"{type_name} {shape} M={M}: error {err.max():.3g}"

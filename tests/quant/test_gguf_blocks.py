"""GGUF block formats kept packed: pack/dequantize against gguf.quants, and the XLA matmul."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from jaxllm.quant import (SUPPORTED_TYPES, dequantize, dequantize_reference, matmul,
                          matmul_reference, pack)

# [out, in] of SmolLM2-135M's weights (hidden 576, MLP 1536, k/v 3 heads x 64 = 192),
# with small out where in is large, and an odd row count.
QUANTIZED_SHAPES = [(192, 576), (64, 1536), (1536, 576), (7, 96)]
# the embedding / lm_head's 49152 rows: random valid blocks (quantizing 28M floats is slow)
BIG_ROWS = (49152, 64)

_dequantize_jit = jax.jit(dequantize)
_matmul_jit = jax.jit(matmul)


def _bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def _quantized(type_name: str, shape, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * 0.05
    return quantize(w, GGMLQuantizationType[type_name])  # [out, in/32 * type_size] u8


def _random_blocks(type_name: str, shape, seed: int) -> np.ndarray:
    """Random quant bytes with finite float16 scales (and mins) at the block's start."""
    qtype = GGMLQuantizationType[type_name]
    type_size = GGML_QUANT_SIZES[qtype][1]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (shape[0], shape[1] // 32, type_size), dtype=np.uint8)
    n_scales = 2 if type_name in ("Q4_1", "Q5_1") else 1  # d, then m
    scales = (rng.standard_normal(blocks.shape[:2] + (n_scales,)) * 0.01).astype(np.float16)
    blocks[..., :2 * n_scales] = scales.view(np.uint8)
    return blocks.reshape(shape[0], -1)


@pytest.mark.parametrize("shape", QUANTIZED_SHAPES)
@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_dequantize_equals_gguf_bit_for_bit(type_name, shape):
    raw = _quantized(type_name, shape, seed=10 * SUPPORTED_TYPES.index(type_name) + QUANTIZED_SHAPES.index(shape))
    pw = pack(raw, GGMLQuantizationType[type_name], shape)
    got = np.asarray(_dequantize_jit(pw))
    want = dequantize_reference(raw, type_name, shape)
    assert got.shape == want.shape == shape and got.dtype == np.float32
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_dequantize_random_blocks_at_vocab_rows(type_name):
    raw = _random_blocks(type_name, BIG_ROWS, seed=3)
    pw = pack(raw, type_name, BIG_ROWS)
    np.testing.assert_array_equal(_bits(_dequantize_jit(pw)),
                                  _bits(dequantize_reference(raw, type_name, BIG_ROWS)))


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_pack_keeps_the_file_bytes(type_name):
    shape = (192, 576)
    raw = _quantized(type_name, shape, seed=1)
    pw = pack(raw, type_name, shape)
    assert pw.nbytes == raw.nbytes
    nb = shape[1] // 32
    assert pw.d.shape == (shape[0], nb) and pw.d.dtype == jnp.uint16
    assert pw.qs.dtype == jnp.uint8 and pw.qs.shape == (shape[0], nb, 32 if type_name == "Q8_0" else 16)
    assert (pw.m is not None) == (type_name in ("Q4_1", "Q5_1"))
    assert (pw.qh is not None) == (type_name in ("Q5_0", "Q5_1"))
    # a pytree: arrays are leaves, type and shape are static (a jit cache key, not traced)
    leaves, treedef = jax.tree_util.tree_flatten(pw)
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)
    assert len(leaves) == 2 + (pw.m is not None) + (pw.qh is not None)
    assert jax.tree_util.tree_unflatten(treedef, leaves).type_name == type_name


@pytest.mark.parametrize("shape", [(192, 576), (64, 1536), (7, 96)])
@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_matmul_matches_float64_reference(type_name, shape):
    raw = _quantized(type_name, shape, seed=2)
    pw = pack(raw, type_name, shape)
    x = np.random.default_rng(4).standard_normal((5, shape[1]), dtype=np.float32)
    got = np.asarray(_matmul_jit(jnp.asarray(x), pw))
    want = matmul_reference(x, raw, type_name, shape)
    assert got.shape == want.shape == (5, shape[0]) and got.dtype == np.float32
    # The weight is exact (bit-equal to the reference's), so the only error is float32
    # rounding of `in` products and sums: for any summation order it is at most
    # gamma_in * sum_i |x_i w_i|, gamma_n = n u / (1 - n u), u = 2^-24 (Higham, Thm 3.1).
    w = dequantize_reference(raw, type_name, shape).astype(np.float64)
    n, u = shape[1], 2.0 ** -24
    bound = n * u / (1 - n * u) * (np.abs(x.astype(np.float64)) @ np.abs(w).T)
    assert np.all(np.abs(got - want) <= bound)


def test_unsupported_types_raise():
    raw = np.zeros((4, 8 * 144), np.uint8)
    for bad in (GGMLQuantizationType.Q4_K, "F16", "NOT_A_TYPE", 9999):
        with pytest.raises(ValueError, match=str(getattr(bad, "name", bad))):
            pack(raw, bad, (4, 256))
        with pytest.raises(ValueError, match=str(getattr(bad, "name", bad))):
            dequantize_reference(raw, bad, (4, 256))


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_bad_shapes_raise(type_name):
    with pytest.raises(ValueError, match=rf"{type_name}.*\(4, 40\).*multiple of the block size 32"):
        pack(np.zeros(4 * 40, np.uint8), type_name, (4, 40))
    with pytest.raises(ValueError, match=rf"{type_name}.*\(4, 64\) needs"):
        pack(np.zeros(7, np.uint8), type_name, (4, 64))
    pw = pack(_quantized(type_name, (4, 64), seed=0), type_name, (4, 64))
    with pytest.raises(ValueError, match=r"x has 32 features.*takes 64"):
        matmul(jnp.zeros((2, 32)), pw)

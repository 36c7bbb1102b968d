"""GGUF block formats kept packed: pack/dequantize against gguf.quants, and the XLA matmul."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from jaxllm.quant import (QK_K, SUPPORTED_TYPES, block_size, dequantize, dequantize_reference,
                          matmul, matmul_reference, pack)

BLOCK32_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # gguf.quants has no quantizer for these: random blocks
FLOAT_TYPES = ("F16", "BF16")

# [out, in] of SmolLM2-135M's weights (hidden 576, MLP 1536, k/v 3 heads x 64 = 192),
# with small out where in is large, and an odd row count.
QUANTIZED_SHAPES = [(192, 576), (64, 1536), (1536, 576), (7, 96)]
# the embedding / lm_head's 49152 rows: random valid blocks (quantizing 28M floats is slow)
BIG_ROWS = (49152, 64)
# K-quants need in % 256 == 0 (SmolLM2's in = 576 is not: llama.cpp stores those tensors
# in another type), so their shapes are the MLP's down projection and multiples of 256.
K_SHAPES = [(576, 1536), (64, 768), (7, 256)]
# offset of the float16 scales in a K-quant block: d (and dmin right after it)
_K_SCALE_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}

_dequantize_jit = jax.jit(dequantize)
_matmul_jit = jax.jit(matmul)


def _bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def _quantized(type_name: str, shape, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * 0.05
    return quantize(w, GGMLQuantizationType[type_name])  # [out, in/32 * type_size] u8


def _random_blocks(type_name: str, shape, seed: int) -> np.ndarray:
    """Random quant bytes with finite float16 scales (and mins) where the type keeps them."""
    qtype = GGMLQuantizationType[type_name]
    type_size = GGML_QUANT_SIZES[qtype][1]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (shape[0], shape[1] // block_size(type_name), type_size),
                          dtype=np.uint8)
    if type_name in _K_SCALE_AT:
        at = _K_SCALE_AT[type_name]
    else:
        at = (0, 2) if type_name in ("Q4_1", "Q5_1") else (0,)  # d, then m
    scales = (rng.standard_normal(blocks.shape[:2] + (len(at),)) * 0.01).astype(np.float16)
    for k, o in enumerate(at):
        blocks[..., o:o + 2] = scales[..., k:k + 1].view(np.uint8)
    return blocks.reshape(shape[0], -1)


def _raw(type_name: str, shape, seed: int) -> np.ndarray:
    """A tensor's file bytes: quantized by gguf where it can, random valid blocks otherwise."""
    if type_name in K_TYPES:
        return _random_blocks(type_name, shape, seed)
    if type_name == "F16":
        w = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * 0.05
        return w.astype(np.float16).view(np.uint8)
    return _quantized(type_name, shape, seed).view(np.uint8)


def test_supported_types_are_the_three_families():
    assert SUPPORTED_TYPES == BLOCK32_TYPES + K_TYPES + FLOAT_TYPES
    assert [block_size(t) for t in SUPPORTED_TYPES] == [32] * 5 + [QK_K] * 3 + [1] * 2


@pytest.mark.parametrize("shape", QUANTIZED_SHAPES)
@pytest.mark.parametrize("type_name", BLOCK32_TYPES + FLOAT_TYPES)
def test_dequantize_equals_gguf_bit_for_bit(type_name, shape):
    raw = _raw(type_name, shape, seed=10 * SUPPORTED_TYPES.index(type_name) + QUANTIZED_SHAPES.index(shape))
    pw = pack(raw, GGMLQuantizationType[type_name], shape)
    got = np.asarray(_dequantize_jit(pw))
    want = dequantize_reference(raw, type_name, shape)
    assert got.shape == want.shape == shape and got.dtype == np.float32
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("shape", K_SHAPES)
@pytest.mark.parametrize("type_name", K_TYPES)
def test_k_quant_dequantize_equals_gguf_bit_for_bit(type_name, shape):
    raw = _raw(type_name, shape, seed=10 * SUPPORTED_TYPES.index(type_name) + K_SHAPES.index(shape))
    pw = pack(raw, type_name, shape)
    got = np.asarray(_dequantize_jit(pw))
    want = dequantize_reference(raw, type_name, shape)
    assert got.shape == want.shape == shape and got.dtype == np.float32
    # random bytes reach every 6-bit scale/min and every quant value, signed and not
    assert np.all(np.isfinite(want)) and (want < 0).any() and (want > 0).any()
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_float_types_keep_every_bit_pattern_but_nan():
    # every finite / infinite 16-bit pattern (subnormals and -0 included), as gguf reads them
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    for type_name, is_nan in (("F16", lambda b: np.isnan(b.view(np.float16))),
                              ("BF16", lambda b: (b & 0x7FFF) > 0x7F80)):
        keep = bits[~is_nan(bits).any(axis=1)]  # whole rows without NaN
        raw = keep.view(np.uint8)
        pw = pack(raw, type_name, keep.shape)
        np.testing.assert_array_equal(_bits(_dequantize_jit(pw)),
                                      _bits(dequantize_reference(raw, type_name, keep.shape)))


@pytest.mark.parametrize("type_name", BLOCK32_TYPES)
def test_dequantize_random_blocks_at_vocab_rows(type_name):
    raw = _random_blocks(type_name, BIG_ROWS, seed=3)
    pw = pack(raw, type_name, BIG_ROWS)
    np.testing.assert_array_equal(_bits(_dequantize_jit(pw)),
                                  _bits(dequantize_reference(raw, type_name, BIG_ROWS)))


@pytest.mark.parametrize("type_name", BLOCK32_TYPES)
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
    assert all(isinstance(leaf, np.ndarray) for leaf in leaves)   # host arrays: device_put moves them
    assert len(leaves) == 2 + (pw.m is not None) + (pw.qh is not None)
    assert jax.tree_util.tree_unflatten(treedef, leaves).type_name == type_name


# [type, field] -> (dtype, bytes per block) of a K-quant's and a float's fields
_FIELD_LAYOUT = {
    "Q4_K": {"d": ("uint16", None), "dmin": ("uint16", None), "scales": ("uint8", 12), "qs": ("uint8", 128)},
    "Q5_K": {"d": ("uint16", None), "dmin": ("uint16", None), "scales": ("uint8", 12),
             "qh": ("uint8", 32), "qs": ("uint8", 128)},
    "Q6_K": {"ql": ("uint8", 128), "qh": ("uint8", 64), "scales": ("int8", 16), "d": ("uint16", None)},
    "F16": {"bits": ("uint16", None)},
    "BF16": {"bits": ("uint16", None)},
}


@pytest.mark.parametrize("type_name", K_TYPES + FLOAT_TYPES)
def test_pack_keeps_the_file_bytes_k_and_float(type_name):
    shape = (64, 768)
    raw = _raw(type_name, shape, seed=1)
    pw = pack(raw, type_name, shape)
    assert pw.nbytes == raw.nbytes == shape[0] * shape[1] // block_size(type_name) * \
        GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]
    nb = shape[1] // block_size(type_name)
    layout = _FIELD_LAYOUT[type_name]
    for name in ("d", "qs", "m", "qh", "dmin", "scales", "ql", "bits"):
        a = getattr(pw, name)
        assert (a is not None) == (name in layout), name
        if a is not None:
            dtype, n = layout[name]
            assert a.dtype == jnp.dtype(dtype), name
            assert a.shape == ((shape[0], nb) if n is None else (shape[0], nb, n)), name
    leaves, treedef = jax.tree_util.tree_flatten(pw)
    assert len(leaves) == len(layout) and all(isinstance(leaf, np.ndarray) for leaf in leaves)
    assert jax.tree_util.tree_unflatten(treedef, leaves).type_name == type_name


MATMUL_CASES = ([(t, s) for t in BLOCK32_TYPES for s in [(192, 576), (64, 1536), (7, 96)]]
                + [(t, s) for t in K_TYPES for s in K_SHAPES]
                + [(t, s) for t in FLOAT_TYPES for s in [(192, 576), (7, 96)]])


@pytest.mark.parametrize("type_name,shape", MATMUL_CASES)
def test_matmul_matches_float64_reference(type_name, shape):
    raw = _raw(type_name, shape, seed=2)
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
    for bad in (GGMLQuantizationType.Q2_K, "F32", "IQ4_XS", "NOT_A_TYPE", 9999):
        with pytest.raises(ValueError, match=str(getattr(bad, "name", bad))):
            pack(raw, bad, (4, 256))
        with pytest.raises(ValueError, match=str(getattr(bad, "name", bad))):
            dequantize_reference(raw, bad, (4, 256))


@pytest.mark.parametrize("type_name", BLOCK32_TYPES)
def test_bad_shapes_raise(type_name):
    with pytest.raises(ValueError, match=rf"{type_name}.*\(4, 40\).*multiple of the block size 32"):
        pack(np.zeros(4 * 40, np.uint8), type_name, (4, 40))
    with pytest.raises(ValueError, match=rf"{type_name}.*\(4, 64\) needs"):
        pack(np.zeros(7, np.uint8), type_name, (4, 64))
    pw = pack(_quantized(type_name, (4, 64), seed=0), type_name, (4, 64))
    with pytest.raises(ValueError, match=r"x has 32 features.*takes 64"):
        matmul(jnp.zeros((2, 32)), pw)


@pytest.mark.parametrize("type_name", K_TYPES)
def test_k_quant_bad_shapes_raise(type_name):
    type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]
    # SmolLM2's hidden size: 2.25 super-blocks per row
    with pytest.raises(ValueError, match=rf"{type_name}.*\(4, 576\).*multiple of the block size 256"):
        pack(np.zeros(4 * 576 // 32 * type_size, np.uint8), type_name, (4, 576))
    with pytest.raises(ValueError, match=rf"{type_name}.*\(4, 512\) needs {4 * 2 * type_size} bytes"):
        pack(np.zeros(4 * type_size, np.uint8), type_name, (4, 512))
    pw = pack(_raw(type_name, (4, 256), seed=0), type_name, (4, 256))
    with pytest.raises(ValueError, match=r"x has 512 features.*takes 256"):
        matmul(jnp.zeros((2, 512)), pw)

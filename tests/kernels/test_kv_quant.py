"""The quantized KV cache's formats (``layers/kv_quant.py``) and the XLA attention path over
them, against float references.

Two references for each format: the same XLA attention over a float32 cache holding exactly
the dequantized values (the only difference left is where the dequantization happens, so the
float32 tolerance applies), and the unquantized attention (the format's own error, bounded
by its precision)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.formats import kv_pages
from jaxllm.layers import kv_quant
from jaxllm.layers.attention import AttentionMetadata, attend

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
# Largest relative rounding error of one value: int8 is relative to the row's max|x| (half a
# step of max/127, plus float16's rounding of the scale); fp8 to the value itself (half an
# ulp: 2^-4 with e4m3's 3 mantissa bits, 2^-3 with e5m2's 2), for normal values.
VALUE_TOL = {"int8": 0.5 / 127 + 2**-11, "fp8_e4m3": 2**-4, "fp8_e5m2": 2**-3}


def quant_cache(x, name, platform="cpu"):
    """A float cache -> the quantized pages the engine would hold for it."""
    fmt = kv_quant.kv_format(name, platform)
    data, scale = kv_quant.quantize(x, fmt, fmt.data_dtype)
    return kv_quant.QuantPages(data, scale, fmt.name)


@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_error_is_within_the_format_precision(name):
    rng = np.random.default_rng(0)
    # Rows of very different magnitudes; fp8 values kept in the formats' normal range.
    x = rng.standard_normal((64, 4, 64)).astype(np.float32) * rng.uniform(0.05, 40, (64, 4, 1)).astype(np.float32)
    back = np.asarray(kv_quant.dequantize(quant_cache(jnp.asarray(x), name)))
    if name == "int8":
        err = np.abs(back - x) / np.abs(x).max(axis=-1, keepdims=True)
    else:
        normal = np.abs(x) > float(jnp.finfo(kv_pages.FP8[name]).smallest_normal)
        err = np.where(normal, np.abs(back - x) / np.maximum(np.abs(x), 1e-30), 0)
    assert err.max() <= VALUE_TOL[name] * 1.0001, err.max()
    assert err.max() > VALUE_TOL[name] / 8             # really quantized, not stored in float


@pytest.mark.parametrize("name", FORMATS)
def test_outliers_saturate_and_zeros_stay_zero(name):
    x = jnp.zeros((3, 1, 8), jnp.float32).at[0, 0, 0].set(1e9).at[1, 0, 3].set(-1e9)
    back = np.asarray(kv_quant.dequantize(quant_cache(x, name)))
    assert np.isfinite(back).all()
    if name == "int8":
        # The float16 scale saturates at its max: 127 * 65504 is the largest magnitude kept.
        big = 127 * float(jnp.finfo(jnp.float16).max)
        assert back[0, 0, 0] == big and back[1, 0, 3] == -big
        y = x.at[0, 0, 0].set(1e5).at[1, 0, 3].set(-3e4)           # in range: kept to int8's precision
        back_y = np.asarray(kv_quant.dequantize(quant_cache(y, name)))
        assert back_y[0, 0, 0] == pytest.approx(1e5, rel=1e-3) and back_y[1, 0, 3] == pytest.approx(-3e4, rel=1e-3)
    else:
        big = float(jnp.finfo(kv_pages.FP8[name]).max)       # vLLM's scale 1.0, clipped
        assert back[0, 0, 0] == big and back[1, 0, 3] == -big
    np.testing.assert_array_equal(back[2], 0)                 # an all-zero row: scale 0, no NaN


def test_fp8_is_stored_as_bits_on_cpu_and_as_fp8_elsewhere():
    assert kv_quant.kv_format("fp8", "cpu").data_dtype == jnp.uint8
    assert kv_quant.kv_format("fp8", "gpu").data_dtype == jnp.float8_e4m3fn
    assert kv_quant.kv_format("fp8_e5m2", "gpu").data_dtype == jnp.float8_e5m2
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 2, 16)), jnp.float32)
    np.testing.assert_array_equal(kv_quant.dequantize(quant_cache(x, "fp8", "cpu")),
                                  kv_quant.dequantize(quant_cache(x, "fp8", "gpu")))


def test_token_bytes():
    # SmolLM2: 3 KV heads of 64.  int8 adds a 2-byte scale per token per head.
    assert kv_quant.token_bytes(3, 64, 4) == 2 * 3 * 64 * 4
    assert kv_quant.token_bytes(3, 64, 2, "int8") == 2 * 3 * (64 + 2)
    assert kv_quant.token_bytes(3, 64, 2, "fp8") == kv_quant.token_bytes(3, 64, 2, "fp8_e5m2") == 2 * 3 * 64
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        kv_quant.token_bytes(3, 64, 2, "int4")


def _batch(seed, Hq=6, Hkv=2, D=64, BS=16, layers=None):
    """A mixed batch (decodes and prefill chunks) over a random paged cache."""
    rng = np.random.default_rng(seed)
    q_lens, ctx = [1, 20, 1, 7], [0, 5, 140, 33]
    n_blocks = [-(-(c + n) // BS) for c, n in zip(ctx, q_lens)]
    MB, NB = max(n_blocks) + 1, sum(n_blocks) + 4
    perm, tables, k = rng.permutation(np.arange(1, NB)), np.zeros((len(q_lens), MB), np.int32), 0
    for s, n in enumerate(n_blocks):
        tables[s, :n] = perm[k:k + n]
        k += n
    seq, pos, slots = [], [], []
    for s, (c, n) in enumerate(zip(ctx, q_lens)):
        p = np.arange(c, c + n)
        seq, pos, slots = seq + [s] * n, pos + p.tolist(), slots + (tables[s, p // BS] * BS + p % BS).tolist()
    T = len(seq)
    md = AttentionMetadata(positions=jnp.asarray(pos, jnp.int32), slot_mapping=jnp.asarray(slots, jnp.int32),
                           token_seq=jnp.asarray(seq, jnp.int32), block_tables=jnp.asarray(tables),
                           seq_lens=jnp.asarray([c + n for c, n in zip(ctx, q_lens)], jnp.int32),
                           query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32))
    shape = (NB, BS, Hkv, D) if layers is None else (layers, NB, BS, Hkv, D)
    r = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32) * 2)  # noqa: E731
    return r(T, Hq, D), r(T, Hkv, D), r(T, Hkv, D), (r(*shape), r(*shape)), md


def run_attend(backend, q, k, v, kv, md, layer=None):
    f = jax.jit(lambda q, k, v, kv, md, *li: attend(q, k, v, kv, li[0] if li else None, md, scale=0.125,
                                                    sliding_window=None, backend=backend))
    return f(q, k, v, kv, md, *(() if layer is None else (jnp.int32(layer),)))


@pytest.mark.parametrize("layers", [None, 3], ids=["per-layer", "stacked"])
@pytest.mark.parametrize("name", FORMATS)
def test_xla_path_equals_float_attention_over_the_dequantized_cache(name, layers):
    q, k, v, (kc, vc), md = _batch(3, layers=layers)
    layer = None if layers is None else 1
    qkv = tuple(quant_cache(c, name) for c in (kc, vc))
    out, (k2, v2) = run_attend("xla", q, k, v, qkv, md, layer)
    assert isinstance(k2, kv_quant.QuantPages) and k2.data.dtype == qkv[0].data.dtype
    # The reference: float32 attention over the dequantized cache, with this step's K/V
    # quantized and dequantized as the write does.
    deq = lambda x: kv_quant.dequantize(quant_cache(x, name))  # noqa: E731
    want, (kf, vf) = run_attend("xla", q, deq(k), deq(v), (deq(kc), deq(vc)), md, layer)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    # The write stored this step's K/V in its slots, quantized (and nothing else changed).
    np.testing.assert_array_equal(np.asarray(kv_quant.dequantize(k2)), np.asarray(kf))
    np.testing.assert_array_equal(np.asarray(kv_quant.dequantize(v2)), np.asarray(vf))
    # Against the unquantized attention: the format's error, relative to the output's scale.
    exact, _ = run_attend("xla", q, k, v, (kc, vc), md, layer)
    err = np.abs(np.asarray(out) - np.asarray(exact)).max() / np.abs(np.asarray(exact)).max()
    assert err < 4 * VALUE_TOL[name], err

"""``jaxllm/formats/int_weights.py``: the jnp dequantization (the XLA path) against the float64
reference, bit for bit after rounding to float32; the online quantizers' error bounds; and
``quant/ops.py`` treating the type like any quantized weight (fusing, stacking, rows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxllm.formats import int_weights as iw
from jaxllm.quant import ops
from support.int_weight_samples import random_weight


@pytest.mark.parametrize("fmt,N,K,group,zero", [("int4", 24, 77, 77, True), ("int4", 16, 96, 32, False),
                                                 ("int8", 8, 100, 30, True), ("fp8", 12, 64, 16, False)])
def test_dequantize_matches_reference(fmt, N, K, group, zero):
    w = random_weight(np.random.default_rng(N + K), fmt, N, K, group, zero)
    got = np.asarray(jax.jit(iw.dequantize)(w))
    np.testing.assert_array_equal(got, iw.dequantize_reference(w).astype(np.float32))
    x = np.random.default_rng(1).standard_normal((3, K)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(iw.matmul(jnp.asarray(x), w)), iw.matmul_reference(x, w),
                               rtol=1e-5, atol=1e-5 * np.abs(iw.matmul_reference(x, w)).max())
    ids = jnp.asarray([3, 0, 3], jnp.int32)
    np.testing.assert_array_equal(np.asarray(ops.take_rows(w, ids)), got[np.asarray(ids)])


def test_online_quantizers_error_bounds():
    w = np.random.default_rng(0).standard_normal((32, 48)).astype(np.float32)
    q8 = iw.quantize_int8(w)
    err = np.abs(iw.dequantize_reference(q8) - w)
    step = np.abs(w).max(axis=1, keepdims=True) / 127
    assert q8.q.dtype == np.int8 and (err <= step / 2 * (1 + 1e-6)).all()
    f8 = iw.quantize_fp8(w)
    rel = np.abs(iw.dequantize_reference(f8) - w) / np.abs(w).max(axis=1, keepdims=True)
    assert f8.q.dtype == ml_dtypes.float8_e4m3fn and rel.max() <= 2 ** -4   # e4m3: 3 mantissa bits
    assert q8.nbytes == 32 * 48 + 32 * 4


def test_ops_fuse_stack_and_refuse_mixed():
    rng = np.random.default_rng(3)
    a, b = (random_weight(rng, "int4", n, 64, 32, True) for n in (16, 8))
    fused = ops.concat_rows([a, b])
    np.testing.assert_array_equal(iw.dequantize_reference(fused),
                                  np.concatenate([iw.dequantize_reference(a), iw.dequantize_reference(b)]))
    assert ops.concat_rows([a, random_weight(rng, "int8", 8, 64, 32, True)]) is None
    assert ops.concat_rows([a, random_weight(rng, "int4", 8, 64, 16, True)]) is None   # other groups
    st = ops.stack([a, a], "q")
    assert st.q.shape == (2, *a.q.shape) and st.shape == a.shape
    with pytest.raises(ValueError, match="quantized differently across layers"):
        ops.stack([a, random_weight(rng, "int8", 16, 64, 32, True)], "q")
    assert ops.format_name(a) == "INT4_G32" and "INT4_G32" in ops.summary([a, b])


def test_make_refuses_bad_fields():
    with pytest.raises(ValueError, match="scale must be"):
        iw.make(np.zeros((4, 8), np.int8), np.ones((4, 2), np.float32), format="int8", group_size=8, shape=(4, 8))
    with pytest.raises(ValueError, match="values must be uint8"):
        iw.make(np.zeros((4, 8), np.int8), np.ones((4, 1), np.float32), format="int4", group_size=8, shape=(4, 8))

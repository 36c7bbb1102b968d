"""The Pallas quantized matmul (``jaxllm/pallas/quant_matmul.py``) in interpret mode against
its plain-jnp reference and the float64 oracle: int8 and int4 with group scales and zero
points, fp8 per channel and per tensor; shapes with tails (M, N, K not multiples of the
blocks, odd K for int4), M from 1 (decode) to prefill sizes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.pallas.quant_matmul import quant_matmul, quant_matmul_jit, quant_matmul_reference
from jaxllm.formats import int_weights as iw
from support.int_weight_samples import random_weight


CASES = [
    # fmt, M, N, K, group, zero point
    ("int4", 1, 64, 128, 32, True),
    ("int4", 5, 40, 96, 32, False),      # N tail
    ("int4", 37, 96, 77, 77, True),      # odd K, per channel, M tail
    ("int4", 128, 64, 256, 128, True),   # prefill-sized
    ("int8", 1, 33, 100, 100, False),
    ("int8", 19, 64, 96, 32, True),      # grouped with zero point
    ("int8", 70, 128, 64, 64, False),
    ("fp8", 1, 70, 64, 64, False),
    ("fp8", 33, 64, 200, 200, False),    # K tail past one 256 block? (200 < 256: padded)
    ("fp8", 9, 48, 96, 32, False),       # blockwise (fine-grained fp8 scales, rows repeated)
]


@pytest.mark.parametrize("fmt,M,N,K,group,zero", CASES)
def test_kernel_matches_reference(fmt, M, N, K, group, zero):
    rng = np.random.default_rng(M * 1000 + N + K)
    w = random_weight(rng, fmt, N, K, group, zero)
    x = rng.standard_normal((M, K)).astype(np.float32)
    got = np.asarray(quant_matmul(jnp.asarray(x), w, interpret=True))
    ref = np.asarray(quant_matmul_reference(jnp.asarray(x), w))
    oracle = iw.matmul_reference(x, w)
    scale = np.abs(oracle).max()
    assert got.shape == (M, N)
    np.testing.assert_allclose(got, oracle, atol=2e-6 * scale * np.sqrt(K), rtol=0)
    np.testing.assert_allclose(got, ref, atol=2e-6 * scale * np.sqrt(K), rtol=0)


def test_fp8_per_tensor_and_small_blocks_jitted():
    rng = np.random.default_rng(7)
    w = random_weight(rng, "fp8", 72, 80, 80, False, per_tensor=True)
    x = rng.standard_normal((3, 80)).astype(np.float32)
    got = np.asarray(quant_matmul_jit(jnp.asarray(x), w, block_m=16, block_n=16, interpret=True))
    np.testing.assert_allclose(got, iw.matmul_reference(x, w), atol=1e-4, rtol=0)


def test_bad_block_refused():
    w = random_weight(np.random.default_rng(0), "int8", 16, 32, 32, False)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        quant_matmul(jnp.zeros((2, 32)), w, block_n=24, interpret=True)

"""The Pallas LoRA kernel (``jaxllm/pallas/lora.py``) in interpret mode against its plain-jnp
reference and a float64 NumPy oracle: ragged slots (tokens of one slot not adjacent, slot -1
tokens getting zeros), two adapters of ranks 4 and 8 padded to rank 8 in one slot array; and
its argument checks.  The engine through this kernel: tests/lora/test_engine.py's Pallas cell."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.pallas.lora import lora_delta, lora_delta_jit, lora_delta_reference

S, IN, OUT, R = 3, 48, 40, 8
RANKS = (4, 8, 0)   # slot 2 empty (all zeros), as an unused slot is


def _slot_arrays(rng):
    """a [S, IN, R], b [S, R, OUT], each slot's rank padded with zeros to R."""
    a = np.zeros((S, IN, R), np.float32)
    b = np.zeros((S, R, OUT), np.float32)
    for s, r in enumerate(RANKS):
        a[s, :, :r] = rng.standard_normal((IN, r)) / np.sqrt(IN)
        b[s, :r, :] = rng.standard_normal((r, OUT)) / np.sqrt(r or 1)
    return a, b


def _oracle(x, a, b, slots):
    out = np.zeros((len(slots), b.shape[-1]))
    for t, s in enumerate(slots):
        if s >= 0:
            out[t] = x[t].astype(np.float64) @ a[s].astype(np.float64) @ b[s].astype(np.float64)
    return out


@pytest.mark.parametrize("slots", [
    [0, 1, -1, 1, 0, 0, -1, 1, 2, 1, 0],   # ragged: slots interleaved, base tokens among them
    [-1, -1, -1],                            # no adapter in the batch
    [1],                                     # one decode token
])
def test_kernel_matches_reference_and_oracle(slots):
    rng = np.random.default_rng(len(slots))
    a, b = _slot_arrays(rng)
    x = rng.standard_normal((len(slots), IN)).astype(np.float32)
    sl = jnp.asarray(slots, jnp.int32)
    got = np.asarray(lora_delta(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), sl, interpret=True))
    ref = np.asarray(lora_delta_reference(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), sl))
    oracle = _oracle(x, a, b, slots)
    assert got.shape == (len(slots), OUT) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, oracle, rtol=1e-5, atol=1e-5)
    base = np.asarray(slots) < 0
    assert not got[base].any()                            # slot -1: exactly zero
    if (~base).any() and any(RANKS[s] for s in slots if s >= 0):
        assert np.abs(got[~base]).max() > 0.1             # the adapters do change something
    jitted = np.asarray(lora_delta_jit(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), sl, interpret=True))
    np.testing.assert_array_equal(jitted, got)


def test_bad_shapes_are_refused():
    x, a, b = jnp.zeros((2, IN)), jnp.zeros((S, IN, R)), jnp.zeros((S, R, OUT))
    with pytest.raises(ValueError, match="slots"):
        lora_delta(x, a, b, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="do not chain"):
        lora_delta(x, a, jnp.zeros((S, R + 1, OUT)), jnp.zeros((2,), jnp.int32))

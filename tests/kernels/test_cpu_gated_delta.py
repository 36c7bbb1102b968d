"""The native one-token gated delta update (``jaxllm/cpu/gated_delta.cc``) against the float64
token loop of layers/gated_delta.py, on state rows in place: padding sequences, fresh ones,
rows no sequence owns, and a sequence's bits whatever the batch around it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.cpu import native
from jaxllm.layers.gated_delta import reference_gated_delta_rule

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="native CPU kernels unavailable here (not a CPU backend, no AVX2/FMA, or no "
                                       "C++ compiler: the reason is in the jaxllm.cpu log)")

_token = jax.jit(native.gdn_token, donate_argnums=(7,))


def _inputs(S, H, Dk, Dv, seed=0):
    r = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)   # noqa: E731  (as prepare() leaves them)
    q = (unit(r.standard_normal((S, H, Dk))) * Dk ** -0.5).astype(np.float32)
    k = unit(r.standard_normal((S, H, Dk))).astype(np.float32)
    v = r.standard_normal((S, H, Dv)).astype(np.float32)
    g = np.log(r.uniform(0.05, 1.0, (S, H))).astype(np.float32)     # decays from near-total to none
    beta = r.uniform(0.0, 1.0, (S, H)).astype(np.float32)
    return q, k, v, g, beta


@pytest.mark.parametrize("H,Dk,Dv", [(3, 16, 40), (2, 128, 128), (2, 8, 6)])   # tiles + tail, Qwen3.5's, tail only
def test_native_token_update_equals_the_token_loop_on_its_rows(H, Dk, Dv):
    S, R = 6, 9
    q, k, v, g, beta = _inputs(S, H, Dk, Dv)
    rows = np.array([7, 2, 0, 9, 5, 3], np.int32)        # sequence 3 is padding (row 9: out of range)
    fresh = np.array([0, 1, 0, 0, 0, 0], np.int32)       # sequence 1 starts from zeros
    s0 = (np.random.default_rng(1).standard_normal((R, H, Dk, Dv)) * 0.5).astype(np.float32)
    s0[2] = np.nan                                       # a fresh sequence's row is never read
    o, states = _token(q, k, v, g, beta, rows, fresh, jnp.asarray(s0))
    o, states = np.asarray(o), np.asarray(states)
    for s, row in enumerate(rows):
        if row >= R:
            assert np.all(o[s] == 0)
            continue
        start = np.zeros_like(s0[row:row + 1]) if fresh[s] else s0[row:row + 1]
        o_ref, s_ref = reference_gated_delta_rule(*(x[None, s:s + 1] for x in (q, k, v, g, beta)), start,
                                                  use_qk_l2norm=False, scale=1.0)
        np.testing.assert_allclose(o[s], o_ref[0, 0], rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(states[row], s_ref[0], rtol=2e-5, atol=2e-5)
    for row in (1, 4, 6, 8):                             # no sequence's: untouched
        np.testing.assert_array_equal(states[row], s0[row])


def test_a_sequences_update_is_the_same_bits_whatever_the_batch():
    # A decode's state and output must not depend on the sequences beside it (the helper
    # threads take other (sequence, head) items in another split).
    H, Dk, Dv = 4, 128, 128
    q, k, v, g, beta = _inputs(16, H, Dk, Dv, seed=3)
    s0 = (np.random.default_rng(4).standard_normal((16, H, Dk, Dv)) * 0.5).astype(np.float32)
    rows = np.arange(16, dtype=np.int32)[::-1].copy()
    fresh = np.zeros(16, np.int32)
    o_all, st_all = (np.asarray(x) for x in _token(q, k, v, g, beta, rows, fresh, jnp.asarray(s0)))
    for s in (0, 5, 15):
        one = lambda x: x[s:s + 1]   # noqa: E731
        o_1, st_1 = _token(*map(one, (q, k, v, g, beta)), rows[s:s + 1], fresh[s:s + 1], jnp.asarray(s0))
        np.testing.assert_array_equal(np.asarray(o_1)[0], o_all[s])
        np.testing.assert_array_equal(np.asarray(st_1)[rows[s]], st_all[rows[s]])

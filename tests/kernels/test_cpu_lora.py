"""The native CPU LoRA shrink and expand (``jaxllm/cpu/lora.cc``) against a float64 NumPy oracle:
ragged slots (one slot's tokens not adjacent, more of them than a block holds, a slot -1 and a
slot past the slot arrays getting nothing), one layer of several, the expand into given
columns of an output from given columns of the shrink (a fused q/k/v), widths off the 64-, 32-
and 8-column tiles; each slot's rank (A's columns and B's rows past it not read: non-zero
here, zeros in the engine's slots); and each token run alone gives the same bits as in the
batch.  The engine through this kernel: tests/lora/test_engine.py's native cells
(token-exact against transformers + peft)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllm.cpu import native

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="native CPU kernels unavailable here (not a CPU backend, no AVX2/FMA, or no "
                                       "C++ compiler: the reason is in the jaxllm.cpu log)")

S, L, IN, R = 3, 2, 45, 16    # IN: the shrink's four chains and a remainder of one
OUTS = (72, 13, 13)     # q, k, v: 64-, 32- and 8-column tiles, then single columns


def test_shrink_and_expand_apply_each_tokens_own_slot():
    rng = np.random.default_rng(0)
    C = len(OUTS) * R
    a = rng.standard_normal((S, L, IN, C)).astype(np.float32)
    a_t = np.ascontiguousarray(a.swapaxes(-1, -2))                       # [S, L, C, IN]: the kernel's layout
    bs = [rng.standard_normal((S, L, R, o)).astype(np.float32) for o in OUTS]
    # 13 tokens: slot 1's ten not adjacent (two blocks of 8), -1 (the base) and 3 (no such slot)
    slots = np.array([1, 1, 0, 1, -1, 1, 1, 1, 3, 1, 1, 1, 1], np.int32)
    ranks = np.array([R, 13, 0], np.int32)   # slot 1 an adapter of rank 13 in rank-16 slots; slot 2 empty
    T, N = len(slots), sum(OUTS)
    x = rng.standard_normal((T, IN)).astype(np.float32)
    y = rng.standard_normal((T, N)).astype(np.float32)

    @jax.jit
    def run(y, x, slots):
        xa = native.lora_shrink(x, a_t, slots, 1, R, ranks)              # [T, C]
        col = 0
        for i, b in enumerate(bs):
            y = native.lora_expand(y, xa, b, slots, 1, col, i * R, ranks)   # [T, N]
            col += b.shape[-1]
        return xa, y

    xa, got = (np.asarray(v) for v in run(y, x, slots))
    own = (slots >= 0) & (slots < S)
    ref_xa = np.zeros((T, C))
    ref_xa[own] = np.einsum("ti,tic->tc", x[own].astype(np.float64), a[slots[own], 1].astype(np.float64))
    past_rank = np.arange(C)[None, :] % R >= ranks[np.clip(slots, 0, S - 1)][:, None]   # [T, C]: A's padding
    ref_xa[past_rank] = 0.0
    ref = y.astype(np.float64)
    col = 0
    for i, b in enumerate(bs):
        o = b.shape[-1]
        rows = np.arange(R)[None, :] < ranks[slots[own]][:, None]             # [t, R]: within the slot's rank
        ref[own, col:col + o] += np.einsum("tr,tro->to", ref_xa[own, i * R:(i + 1) * R] * rows, b[slots[own], 1])
        col += o
    np.testing.assert_allclose(xa, ref_xa, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[~own], y[~own])        # no slot: y untouched, bit for bit
    assert np.abs(got[own] - y[own]).max() > 1.0             # and the deltas are there
    # each token alone (its own step of one token): the same bits as beside the others
    for t in range(T):
        xa1, got1 = (np.asarray(v) for v in run(y[t:t + 1], x[t:t + 1], slots[t:t + 1]))
        np.testing.assert_array_equal(xa1[0], xa[t])
        np.testing.assert_array_equal(got1[0], got[t])

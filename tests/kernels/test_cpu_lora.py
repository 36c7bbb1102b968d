"""The native CPU LoRA call (``jaxllm/cpu/lora.cc``: shrink, then expand) against a float64 NumPy oracle:
ragged slots (one slot's tokens not adjacent, more of them than a block holds, a slot -1 and a
slot past the slot arrays getting nothing), one layer of several, the expand into given
columns of an output from given parts of the shrink (a fused q/k/v; q, k and v each their own
output; v alone), widths off the 64-, 32- and 8-column tiles; each slot's rank (A's columns and B's rows past it not read: non-zero
here, zeros in the engine's slots); and each token run alone gives the same bits as in the
batch.  The engine through this kernel: tests/lora/test_engine.py's native cells
(token-exact against transformers + peft)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.cpu import native

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="native CPU kernels unavailable here (not a CPU backend, no AVX2/FMA, or no "
                                       "C++ compiler: the reason is in the jaxllm.cpu log)")

S, L, IN, R = 3, 2, 45, 16    # IN: two chunks of 16, one of 8 and a masked tail of 5
OUTS = (72, 13, 13)     # q, k, v: 64-, 32- and 8-column tiles, then single columns


def test_lora_add_applies_each_tokens_own_slot():
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
    cols = [0, OUTS[0], OUTS[0] + OUTS[1]]
    parts = [(j, j * R) for j in range(len(OUTS))]                       # (B, its part of A) for q, k, v

    @jax.jit
    def run(y, x, slots):
        fused = native.lora_add([y], x, a_t, bs, slots, 1, ranks, [0, 0, 0], cols, [r0 for _, r0 in parts])
        # each projection its own output, and v's alone (its part the third of A)
        split = native.lora_add([y[:, c:c + o] for c, o in zip(cols, OUTS)], x, a_t, bs, slots, 1, ranks,
                                [0, 1, 2], [0, 0, 0], [r0 for _, r0 in parts])
        v_alone = native.lora_add([y[:, cols[2]:]], x, a_t, bs[2:], slots, 1, ranks, [0], [0], [2 * R])
        return fused[0], jnp.concatenate(split, axis=1), v_alone[0]

    got, got_split, got_v = (np.asarray(v) for v in run(y, x, slots))
    own = (slots >= 0) & (slots < S)
    s_own = slots[own]
    xa = np.einsum("ti,tic->tc", x[own].astype(np.float64), a[s_own, 1].astype(np.float64))   # [t, C]
    ref = y.astype(np.float64)
    for j, (col, o) in enumerate(zip(cols, OUTS)):
        rows = np.arange(R)[None, :] < ranks[s_own][:, None]                   # [t, R]: within the slot's rank
        ref[own, col:col + o] += np.einsum("tr,tro->to", xa[:, j * R:(j + 1) * R] * rows, bs[j][s_own, 1])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got_split, got)                    # the same sums, whatever the outputs
    np.testing.assert_array_equal(got_v, got[:, cols[2]:])
    np.testing.assert_array_equal(got[~own], y[~own])                # no slot: y untouched, bit for bit
    assert np.abs(got[own] - y[own]).max() > 1.0                     # and the deltas are there
    # each token alone (its own step of one token): the same bits as beside the others
    for t in range(T):
        alone = np.asarray(run(y[t:t + 1], x[t:t + 1], slots[t:t + 1])[0])
        np.testing.assert_array_equal(alone[0], got[t])

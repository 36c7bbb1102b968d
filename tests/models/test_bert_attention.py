"""BERT's windowed attention (jaxllm/models/bert/model.py): on a step of many short prompts laid
side by side, query tiles against their key windows give what the dense same-prompt mask gives,
at the step's start, middle and end (windows moved inside the step) and with padding after the
last prompt, for prompts as long as ``max_len`` and prompts crossing tile edges."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.models.bert.model import TILE, _dense, _windowed


@pytest.mark.parametrize("lengths,T,max_len", [
    ([40, 7, 40, 33, 1, 40, 12, 40, 40, 40, 39, 40, 40, 40, 40, 40, 40, 40, 40, 40], 1024, 40),   # padding at the end
    ([TILE // 2 + 5] * 7, 7 * (TILE // 2 + 5), TILE // 2 + 5),                                    # T not a tile multiple
])
def test_windowed_equals_dense(lengths, T, max_len):
    assert T > TILE + 2 * (max_len - 1) and sum(lengths) <= T
    rng = np.random.default_rng(0)
    H, Dh = 2, 8
    q, k, v = (rng.normal(size=(T, H, Dh)).astype(np.float32) for _ in range(3))
    seq = np.full(T, -1, np.int32)
    seq[:sum(lengths)] = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    real = seq >= 0
    want = np.asarray(_dense(q, k, v, seq))[real]
    got = np.asarray(_windowed(q, k, v, seq, max_len))[real]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

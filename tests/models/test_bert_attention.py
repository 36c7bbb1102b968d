"""BERT's windowed attention (jaxllm/models/bert/model.py): on a step of many short prompts laid
side by side, query tiles against their key windows, and prompts moved into a grid of rows, give
what the dense same-prompt mask gives,
at the step's start, middle and end (windows moved inside the step) and with padding after the
last prompt, for prompts as long as ``max_len`` and prompts crossing tile edges."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.models.bert.model import TILE, _dense, _per_prompt, _windowed, attention_layout


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
    pos = np.zeros(T, np.int32)
    pos[:sum(lengths)] = np.concatenate([np.arange(n) for n in lengths])
    rows = len(lengths) + 3   # and empty rows, as a bucket has
    per = np.asarray(_per_prompt(q, k, v, seq, pos, rows, max_len))
    np.testing.assert_allclose(per[real], want, rtol=1e-5, atol=1e-5)
    assert not per[~real].any()


def test_layout_is_the_fewest_scores():
    assert attention_layout(4096, 32, 128) == "per_prompt"     # 32 prompts near max_len: 32 x 128^2
    assert attention_layout(8192, 256, 512) == "windowed"      # many short prompts, long max_len
    assert attention_layout(128, 1, 128) in ("dense", "per_prompt")
    assert attention_layout(4096, 32, None) == "dense"

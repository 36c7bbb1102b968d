"""``pooling/pool.py``, the encoder step's pooling, on a padded ragged batch as the runner packs
it (prompts of 3, 1 and 4 tokens, padding tokens and an empty padding row): CLS is each prompt's
first token, LAST its last, MEAN the average of its own tokens only, normalize per vector; each
computed per prompt in numpy from the prompt's own rows (sentence-transformers' definitions)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.pooling.config import PoolerConfig
from jaxllm.pooling.pool import pool

LENS = (3, 1, 4)


def _batch():
    rng = np.random.default_rng(0)
    T = sum(LENS) + 2                                                   # two padding tokens
    hidden = rng.normal(size=(T, 5)).astype(np.float32)                 # [T, D]
    seq_ids = np.full(T, -1, np.int32)
    qsl = np.zeros(len(LENS) + 2, np.int32)                             # [S+1]: one empty padding row
    for s, n in enumerate(LENS):
        qsl[s + 1] = qsl[s] + n
        seq_ids[qsl[s]:qsl[s + 1]] = s
    qsl[-1] = qsl[-2]
    return hidden, seq_ids, qsl


@pytest.mark.parametrize("kind", ["CLS", "LAST", "MEAN"])
@pytest.mark.parametrize("normalize", [False, True])
def test_each_prompt_pools_its_own_tokens(kind, normalize):
    hidden, seq_ids, qsl = _batch()
    out = np.asarray(pool(PoolerConfig(kind, normalize=normalize), hidden, seq_ids, qsl))
    assert out.shape == (len(LENS) + 1, hidden.shape[1])
    for s in range(len(LENS)):
        rows = hidden[qsl[s]:qsl[s + 1]]                                # this prompt's tokens only
        want = {"CLS": rows[0], "LAST": rows[-1], "MEAN": rows.mean(0)}[kind]
        if normalize:
            want = want / np.linalg.norm(want)
        np.testing.assert_allclose(out[s], want, rtol=1e-5, atol=1e-6)

"""DeepSeek-V2 / V3 (multi-head latent attention) at tp=2 on simulated CPU devices equal one device.

The sharded runs happen in a subprocess (mla_tp_probe.py): the device count must be set
before JAX starts.  The query, ``kv_b_proj`` (W_UK and W_UV) and output projections split by
head, the latent pages replicated (one latent per token serves every head); logits within
1e-4 relative of tp=1, 32 greedy tokens identical, and V2's engine at tp=2 (chunked prefill into
the replicated latent pages) gives the same tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.tiny_models import build_tiny
from support.tp_probe import run_probe

VARIANTS = ("deepseek_v2", "deepseek_v3")


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla_tp")
    return run_probe("mla_tp_probe", root, [build_tiny(v, str(root / v)) for v in VARIANTS])


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp2_equals_one_device(probe, variant):
    arrays, meta = probe
    ref, got = arrays[f"{variant}/tp1"], arrays[f"{variant}/tp2"]
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"{variant}: max relative logit error {rel:.2e} at tp=2"
    assert meta[f"{variant}/tp2"]["tokens"] == meta[f"{variant}/tp1"]["tokens"]
    assert meta[f"{variant}/tp2"]["all_reduce"]


def test_heads_split_and_latent_replicated(probe):
    meta = probe[1]
    v3 = meta["deepseek_v3/tp2"]["shards"]       # layer 0 (unrolled): 4 heads, 2 per device
    assert v3["q_b"][-2] == 2 * (16 + 8) and v3["kv_b"][-2] == 2 * (16 + 24) and v3["o"][-1] == 2 * 24
    assert v3["kv_a"][-2] == 32 + 8 and v3["q_a"][-2] == 24          # the latents: whole on every device
    assert v3["kv"] == [meta["deepseek_v3/tp1"]["shards"]["kv"][0], 8, 32 + 8]   # pages replicated
    v2 = meta["deepseek_v2/tp2"]["shards"]       # stacked: [L, rows, cols]
    assert v2["kv_b"][-2] == 2 * (16 + 24) and v2["experts_gate"][-2] == 16   # experts' width split


def test_engine_tokens_at_tp2(probe):
    meta = probe[1]
    assert meta["engine/deepseek_v2/tp2"]["tokens"] == meta["deepseek_v2/tp1"]["tokens"]

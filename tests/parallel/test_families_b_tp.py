"""Phi-3 (fused qkv split at load, LongRoPE, partial rotary) and GLM-4-MoE (dense first layer,
shared experts, grouped sigmoid routing) at tp=2 on simulated CPU devices equal one device.

The sharded runs happen in a subprocess (families_b_probe.py): the device count must be set
before JAX starts.  Logits within 1e-4 relative of tp=1, 32 greedy tokens identical, the
attention heads, the MLP width and the shared experts really split.  The engine at tp=2 is
family-blind and runs in test_tensor_parallel.py (Llama; Qwen3-MoE with expert parallelism);
Phi-3's engine (LongRoPE across the factor switch) against transformers at tp=1:
tests/models/test_families_b.py.  So a Phi-3 engine at tp=2 (the cell dropped here) is the
product of what those and the tp2 cells below show.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.tiny_models import build_tiny
from support.tp_probe import run_probe

VARIANTS = ("phi3", "glm4_moe")


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    root = tmp_path_factory.mktemp("families_b_tp")
    return run_probe("families_b_probe", root, [build_tiny(v, str(root / v)) for v in VARIANTS])


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp2_equals_one_device(probe, variant):
    arrays, meta = probe
    ref, got = arrays[f"{variant}/tp1"], arrays[f"{variant}/tp2"]
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"{variant}: max relative logit error {rel:.2e} at tp=2"
    assert meta[f"{variant}/tp2"]["tokens"] == meta[f"{variant}/tp1"]["tokens"]
    assert meta[f"{variant}/tp2"]["all_reduce"]


def test_weights_are_split(probe):
    meta = probe[1]
    phi3 = meta["phi3/tp2"]["shards"]
    # Stacked layers: [L, rows, cols]; q is 4 heads of 16, the MLP 160 wide.
    assert phi3["q"][-2] == 32 and phi3["k"][-2] == 16 and phi3["gate"][-2] == 80 and phi3["down"][-1] == 80
    glm = meta["glm4_moe/tp2"]["shards"]   # layer 0 (unrolled): the dense one
    assert glm["q"][-2] == 32 and glm["gate"][-2] == 48

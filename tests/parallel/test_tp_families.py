"""Gemma 2, Gemma 3 and GPT-OSS at tp=2 on simulated CPU devices equal one device.

The sharded runs happen in one subprocess (tp_families_probe.py).  For each tiny checkpoint
(tests/support/tiny_families.py): the prompt's logits within 1e-4 relative of tp=1 in float32 and 32
greedy tokens identical, on the XLA path and with the Pallas kernel per device (GPT-OSS's
sinks split with their heads; Gemma 2's soft-cap and window); and the weights really split.
The engine at tp=2 is family-blind and runs on other families (tp_families_probe.PALLAS's
comment says where).  (tp=1 against transformers, the engine included: tests/models/test_gemma.py,
test_gpt_oss.py.)
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

from support.probes import probe_command, probe_env
from support.tiny_families import family_checkpoints  # noqa: F401  (fixture)
from support.tp_families_probe import PALLAS

NAMES = ("gemma2", "gemma3", "gpt_oss")


@pytest.fixture(scope="module")
def probe(family_checkpoints, tmp_path_factory):  # noqa: F811
    root = os.path.dirname(family_checkpoints["gemma3"])
    out = str(tmp_path_factory.mktemp("tp_families") / "probe.npz")
    env = probe_env(XLA_FLAGS="--xla_force_host_platform_device_count=2")
    r = subprocess.run(probe_command("tp_families_probe", root, out, ",".join(NAMES)),
                       env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    with open(out + ".json") as f:
        meta = json.load(f)
    return dict(np.load(out)), meta


# The Pallas kernel per device runs on the families whose kernel features it adds
# (tp_families_probe.PALLAS: GPT-OSS's split sinks, Gemma 2's soft-cap and window); Gemma 3's
# attention is Gemma 2's to the kernel.
RUNS = [(n, "tp2") for n in NAMES] + [(n, "tp2/pallas") for n in PALLAS]


@pytest.mark.parametrize("name,run", RUNS, ids=[f"{n}-{r}" for n, r in RUNS])
def test_logits_and_greedy_tokens_equal_one_device(probe, name, run):
    arrays, meta = probe
    ref, got = arrays[f"{name}/tp1"], arrays[f"{name}/{run}"]
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"{name}/{run}: max relative logit error {rel:.2e} against tp=1"
    assert meta[f"{name}/{run}"]["tokens"] == meta[f"{name}/tp1"]["tokens"]


@pytest.mark.parametrize("name", NAMES)
def test_weights_are_split(probe, name, family_checkpoints):  # noqa: F811
    from jaxllm.models.loader import load_model
    arch = load_model(family_checkpoints[name]).arch
    meta = probe[1]
    shards = meta[f"{name}/tp2"]["shards"]
    assert shards["q"][0] == arch.q_size // 2 and shards["o"][1] == arch.q_size // 2, shards
    if name == "gpt_oss":
        assert shards["sinks"] == [arch.num_heads // 2], shards
    assert meta[f"{name}/tp2"]["all_reduce"]


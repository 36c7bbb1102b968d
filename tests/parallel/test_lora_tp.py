"""LoRA under tensor parallelism: a tp=2 engine on simulated CPU devices gives the tokens of
transformers + peft (which the tp=1 engine gives on the same builders: tests/lora/test_engine.py)
for one batch of two adapters and the base.

The engines run in a subprocess (support/lora_tp_probe.py: the device count is fixed before
JAX starts), with the strict compile guard; at tp=2 a third adapter then evicts one from its
slot (a load that compiles nothing).  The slot arrays are laid out like the base weights:
A split like the base's input, B like its output (parallel/sharding.py ``lora_specs``).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from support.lora_adapters import build_set, hf_greedy
from support.lora_tp_probe import ITEMS, N, PROMPTS
from support.probes import probe_command, probe_env


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return build_set(str(tmp_path_factory.mktemp("lora_tp")))


@pytest.fixture(scope="module")
def probe(paths, tmp_path_factory):
    out = os.path.join(str(tmp_path_factory.mktemp("lora_tp_probe")), "probe.json")
    env = probe_env(XLA_FLAGS="--xla_force_host_platform_device_count=2")
    cmd = probe_command("lora_tp_probe", out, paths["base"], paths["a4"], paths["b8"], paths["c8"])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    with open(out) as f:
        return json.load(f)


def test_tp2_batch_of_two_adapters_and_the_base_equals_peft(paths, probe):
    ref = hf_greedy(paths["base"], {n: n and paths[n] for n in (None, "a4", "b8", "c8")}, PROMPTS, N)
    want = [ref[item] for item in ITEMS]
    assert probe["tp2"] == want
    assert probe["evicting"] == [ref[("c8", 1)]]


def test_slot_arrays_split_like_the_base_weights(probe):
    full, shards = probe["full"], probe["shards"]
    for col in ("q", "k", "v", "gate", "up"):    # column-parallel: A whole, B split by output
        assert shards[col][0] == full[col][0]
        assert shards[col][1][-1] * 2 == full[col][1][-1]
    for row in ("o", "down"):                    # row-parallel: A split by input, B whole
        assert shards[row][0][-2] * 2 == full[row][0][-2]
        assert shards[row][1] == full[row][1]

"""Packed GGUF weights under tensor parallelism (2 simulated CPU devices, in a subprocess:
the device count is fixed before JAX starts) give the tokens of one device.

The tiny Llama's MLP is 160 wide: 5 blocks of 32 along the down projection's input, which
cannot be split in two, so that weight stays whole on each device (sharding.param_specs)
while q/k/v, o and gate/up are split; a sharding that split a block, or that left a whole
weight and its sharded input disagreeing, would fail to compile or change the tokens.
"""

from __future__ import annotations

import json
import subprocess

import gguf
import pytest

from support.probes import probe_command, probe_env
from support.tiny_models import write_gguf

TYPES = ("Q8_0", "Q4_1")


@pytest.fixture(scope="module")
def probe(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("packed_tp")
    paths = []
    for t in TYPES:
        paths.append(str(root / f"tiny-{t}.gguf"))
        write_gguf(tiny_llama, paths[-1], matrix_type=gguf.GGMLQuantizationType[t])
    out = str(root / "probe.json")
    env = probe_env(XLA_FLAGS="--xla_force_host_platform_device_count=2")
    r = subprocess.run(probe_command("packed_tp_probe", out, *paths), env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("type_name", TYPES)
def test_tp2_on_packed_weights_equals_one_device(probe, type_name):
    one, two = probe[f"tiny-{type_name}.gguf/tp1"], probe[f"tiny-{type_name}.gguf/tp2"]
    assert two["tokens"] == one["tokens"]
    err = max(abs(a - b) for x, y in zip(one["logprobs"], two["logprobs"]) for a, b in zip(x, y))
    print(f"{type_name}: max |logprob tp2 - tp1| = {err:.2e}")
    assert err < 1e-3
    # The blocks really are split where they can be (tp=2 keeps q/k/v and gate/up unfused):
    # the tiny Llama's 64 q rows, 2 of o's input blocks; down's 5 input blocks stay whole.
    half = two["shards"]
    # Both engines ran one step program (packed_tp_probe.PROMPTS: prefill and decode in one bucket).
    assert one["buckets"] == two["buckets"] == [[2, 2]], (one["buckets"], two["buckets"])
    assert half["q"]["qs"][0] == 32 and half["gate"]["qs"][0] == 80, half
    assert half["o"]["qs"][:2] == [64, 1], half["o"]
    assert half["down"]["qs"][:2] == [64, 5], half["down"]

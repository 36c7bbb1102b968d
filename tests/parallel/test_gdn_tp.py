"""Qwen3-Next / Qwen3.5 (hybrid GDN) at tp=2 on simulated CPU devices equal one device.

The sharded runs happen in a subprocess (gdn_tp_probe.py): the device count must be set
before JAX starts.  The GDN layers split by key-head group: the fused (Qwen3-Next) or
regrouped (Qwen3.5) q/k/v projection, the conv, z/b/a, dt_bias/A_log and the output
projection's columns, and the cache with them (conv states by channel group, delta states by
value head, the full-attention pages by KV head).  Logits within 1e-4 relative of tp=1, 32
greedy tokens identical, with the XLA path (Qwen3-Next) and the Pallas GDN decode kernel
(Qwen3.5; gdn_tp_probe.RUNS says why one backend each); the compiled step gathers nothing but
the logits; Qwen3-Next's engine at tp=2 (chunked prefill carrying the sharded states) gives
the same tokens.  The every-bucket warm-up at tp=2 (buckets no step runs compiled up front)
is the multi-host engine's (test_multihost.py: tp=2 over two hosts compiles all up front).
"""

from __future__ import annotations

import numpy as np
import pytest
from support.tiny_hybrid import VOCAB, build
from support.tp_probe import run_probe

ARCHS = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("gdn_tp")
    return root, {a: build(a, str(root / a)) for a in ARCHS}


@pytest.fixture(scope="module")
def probe(ckpts):
    root, paths = ckpts
    return run_probe("gdn_tp_probe", root, [paths[a] for a in ARCHS])


SHARDED = ("Qwen3NextForCausalLM/tp2", "Qwen3_5ForCausalLM/tp2/pallas")


@pytest.mark.parametrize("key", SHARDED)
def test_tp2_equals_one_device(probe, key):
    arrays, meta = probe
    base = key.split("/")[0] + "/tp1"
    ref, got = arrays[base], arrays[key]
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"{key}: max relative logit error {rel:.2e}"
    assert meta[key]["tokens"] == meta[base]["tokens"]
    assert len(set(meta[base]["tokens"])) > 3, "degenerate greedy run"
    assert meta[key]["all_reduce"]


def test_gdn_heads_and_states_split(probe):
    meta = probe[1]
    # Layer 0 is a GDN layer: 2 key heads of 16, 4 value heads of 8, conv channels 2*32 + 32.
    nxt, q35 = (meta[k]["shards"] for k in SHARDED)
    assert nxt["in_qkvz"] == [(2 * 32 + 2 * 32) // 2, 64] and nxt["in_ba"] == [4, 64]
    assert q35["in_qkv"] == [96 // 2, 64] and q35["in_z"] == [16, 64] and q35["in_b"] == [2, 64]
    for s in (nxt, q35):
        assert s["conv"] == [48, 1, 4] and s["out"] == [64, 16] and s["A_log"] == [2] and s["dt_bias"] == [2]
        # 2 full-attention layers' K and V pages [blocks, 8, Hkv, 16], 3 GDN layers' states.
        pages, convs, deltas = s["cache"][:4], s["cache"][4:7], s["cache"][7:]
        assert all(p[2:] == [1, 16] for p in pages)
        assert convs == [[1, 3, 48]] * 3 and deltas == [[1, 2, 16, 8]] * 3


def test_only_the_logits_are_gathered(probe):
    # Nothing of a GDN layer is assembled whole: a layout where a device's slice of the conv
    # channels were not its own heads' would gather the channels (or the states) every step.
    meta = probe[1]
    for key in SHARDED:
        assert meta[key]["all_gathers"] == [[1, VOCAB]], (key, meta[key]["all_gathers"])


def test_engine_tokens_at_tp2(probe):
    meta = probe[1]
    assert meta["engine/Qwen3NextForCausalLM/tp2"]["tokens"] == meta["Qwen3NextForCausalLM/tp1"]["tokens"]


def test_tp_must_divide_the_key_heads(ckpts):
    from jaxllm.models.loader import load_model
    from jaxllm.parallel.sharding import rules_for
    arch = load_model(ckpts[1]["Qwen3_5ForCausalLM"]).arch
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 must divide the number of linear-attention "
                                         r"key heads \(2\)"):
        rules_for(arch, 4)

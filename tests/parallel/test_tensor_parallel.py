"""Tensor (and expert) parallelism on 4 simulated CPU devices equals one device.

The sharded runs happen in one subprocess (tp_probe.py): the device count must be fixed
before JAX starts, and the rest of the suite runs on a single device.  For the tiny Llama
checkpoints (GQA with KV heads that split; one KV head, replicated, with tied embeddings) and
the MoE one (qwen3_moe) at tp=2 (tp_probe.NOT_SWEPT: the variants left out, and the sharded
runs of other files that split the same parameters with their features), and at tp=4 where it adds a case (tp_probe.TP4): prompt logits within 1e-4
relative of tp=1 in float32, 32 greedy tokens identical, weights and cache really split (shard shapes), and
the compiled forward communicating (an all-reduce joins the row-parallel halves) without
gathering any weight (expert parallelism keeps each device on its own experts).  The
engine end to end with expert parallelism (chunked prefill, sharded AOT compile under the
strict compile guard; tp_probe.ENGINE says where the plain tp=2 engine runs) gives the same
tokens, and so does the Pallas attention kernel run per device under shard_map.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

from support.probes import probe_command, probe_env
from support.tiny_models import VARIANTS
from support.tp_probe import ENGINE, EP, NOT_SWEPT, TP4


@pytest.fixture(scope="module")
def probe(tiny_checkpoints, tmp_path_factory):
    """(logits by run key, metadata by run key) from tp_probe.py on 4 simulated CPU devices."""
    root = os.path.dirname(next(iter(tiny_checkpoints.values())))
    out = str(tmp_path_factory.mktemp("tp") / "probe.npz")
    env = probe_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = subprocess.run(probe_command("tp_probe", root, out), env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    with open(out + ".json") as f:
        meta = json.load(f)
    return dict(np.load(out)), meta


def _is_moe(variant: str) -> bool:
    return VARIANTS[variant][0] in ("Qwen3MoeConfig", "MixtralConfig")


SWEPT = [v for v in sorted(VARIANTS) if v not in NOT_SWEPT]
# tp=2 on every swept variant (and expert parallel on qwen3_moe, tp_probe.EP); tp=4 only where
# it shows what tp=2 does not (tp_probe.TP4: KV heads replicated, experts 2 to a device).  The
# tp=4 cells left out (llama3_rope_tied, qwen3_moe without ep) split the same weights the same
# way as their tp=2 cells; mixtral/ep (tp=2 and 4) is the dispatch of qwen3_moe/tp2/ep and
# qwen3_moe/tp4/ep.  The variants not swept: tp_probe.NOT_SWEPT says which tp2 cell of which
# file covers each.
CASES = ([(v, 2, False) for v in SWEPT] + [(v, 2, True) for v in SWEPT if v in EP]
         + [(v, 4, ep) for v, ep in sorted(TP4)])


def _key(variant, tp, ep):
    return f"{variant}/tp{tp}{'/ep' if ep else ''}"


@pytest.mark.parametrize("variant,tp,ep", CASES, ids=[_key(*c) for c in CASES])
def test_logits_and_greedy_tokens_equal_one_device(probe, variant, tp, ep):
    arrays, meta = probe
    key = _key(variant, tp, ep)
    assert "error" not in meta[key], meta[key]
    ref, got = arrays[f"{variant}/tp1"], arrays[key]
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"{key}: max relative logit error {rel:.2e} against tp=1"
    assert meta[key]["tokens"] == meta[f"{variant}/tp1"]["tokens"]


@pytest.mark.parametrize("variant,tp,ep", CASES, ids=[_key(*c) for c in CASES])
def test_weights_and_cache_are_split(probe, variant, tp, ep, tiny_checkpoints):
    from jaxllm.models.loader import load_model
    arch = load_model(tiny_checkpoints[variant]).arch
    meta = probe[1][_key(variant, tp, ep)]
    shards = meta["shards"]
    # Stacked layers (all but one variant) carry a leading layer axis.
    q_rows = shards["q"][-2]
    assert q_rows == arch.q_size // tp, shards
    assert shards["o"][-1] == arch.q_size // tp, shards
    assert shards["embed"][0] == arch.vocab_size // tp, shards
    kv_heads = shards["kv"][-2]
    assert kv_heads == (arch.num_kv_heads // tp if arch.num_kv_heads % tp == 0 else arch.num_kv_heads), shards
    if _is_moe(variant):
        if ep:
            assert shards["experts_gate"][-3] == arch.num_experts // tp, shards
        else:
            assert shards["experts_gate"][-2] == arch.moe_intermediate_size // tp, shards
    else:
        assert shards["gate"][-2] == arch.intermediate_size // tp, shards
    assert meta["all_reduce"], "the sharded forward never communicates: it is not tensor-parallel"
    # Only activations are assembled whole (the program is decode-shaped: their leading dim
    # is the one token, e.g. the logits [1, V]); no weight (an expert stack, say) is gathered
    # onto every device to be computed on.
    assert all(shape[0] == 1 for shape in meta["all_gathers"]), meta["all_gathers"]


@pytest.mark.parametrize("key", [_key(*e) for e in ENGINE])
def test_engine_end_to_end(probe, key):
    meta = probe[1]
    assert meta[f"engine/{key}"]["tokens"] == meta[f"{key.split('/')[0]}/tp1"]["tokens"]


def test_pallas_attention_per_device(probe):
    arrays, meta = probe
    ref, got = arrays["llama_gqa_untied/tp1"], arrays["llama_gqa_untied/tp2/pallas"]
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4
    assert meta["llama_gqa_untied/tp2/pallas"]["tokens"] == meta["llama_gqa_untied/tp1"]["tokens"]


def test_rules_refuse_what_does_not_split(tiny_checkpoints):
    from jaxllm.models.loader import load_model
    from jaxllm.parallel.sharding import rules_for
    arch = load_model(tiny_checkpoints["llama_gqa_untied"]).arch   # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 must divide the number of attention heads"):
        rules_for(arch, 3)
    with pytest.raises(ValueError, match="--enable-expert-parallel: LlamaForCausalLM has no experts"):
        rules_for(arch, 2, expert_parallel=True)
    assert rules_for(arch, 4)["kv_heads"] is None      # fewer KV heads than shards: replicated
    assert rules_for(arch, 2)["kv_heads"] == "tp"

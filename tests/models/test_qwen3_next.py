"""Qwen3-Next / Qwen3.5 / Qwen3.5-MoE (models/qwen3_next.py) against transformers.

Tiny random-weight checkpoints of each architecture, built and saved by transformers:
5 layers (GDN, full, GDN, GDN, full), key and value head dims that differ, grouped value
heads, partial rotary.  Qwen3-Next: MoE with a dense layer (mlp_only_layers), routing
weights not renormalised; Qwen3.5: dense, tied embeddings; Qwen3.5-MoE: MoE everywhere.
The 70-token prompt is longer than one GDN chunk here (16) and in transformers (64), and
is prefilled in two calls whose GDN/conv states and KV cache carry over.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
import transformers
from support import qwen3_next_dense as qn
from support.tiny_hybrid import COMMON, MOE, VARIANTS, VOCAB, build

from jaxllm.errors import ModelLoadError
from jaxllm.runner.compile import enable_persistent_cache

PROMPT_LEN, NEW_TOKENS, CHUNK = 70, 32, 16


@pytest.fixture(scope="module", autouse=True)
def _persistent_xla_cache():
    # The engines' cache folder (conftest sets JAXLLM_CACHE_DIR): reruns skip the compiles.
    enable_persistent_cache(os.path.join(os.environ["JAXLLM_CACHE_DIR"], "xla"))


@pytest.fixture(scope="module", params=list(VARIANTS))
def hybrid(request, tmp_path_factory):
    path = build(request.param, str(tmp_path_factory.mktemp(request.param)))
    model = getattr(transformers, request.param).from_pretrained(path, dtype=torch.float32).eval()
    return path, model


# Three rows everywhere: the ragged batch and the Pallas decode test run the logits test's
# programs (one prefill program of 35 tokens and one decode program per variant, the cache
# sized PROMPT_LEN + NEW_TOKENS) instead of compiling their own.
BATCH = 3


def _prompt(seed=1, B=BATCH):
    return np.random.default_rng(seed).integers(0, VOCAB, (B, PROMPT_LEN)).astype(np.int32)


def test_logits_and_greedy_match_transformers(hybrid):
    path, model = hybrid
    cfg, params = qn.load(path)
    prompt = _prompt()
    with torch.no_grad():
        want = model(torch.from_numpy(prompt).long()).logits.numpy()
        want_tokens = model.generate(torch.from_numpy(prompt).long(), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     min_new_tokens=NEW_TOKENS)[:, PROMPT_LEN:].numpy()
    # Prefill in two calls (35 tokens each: two full GDN chunks and a ragged tail each), every
    # row's length given as ``generate`` gives it: the same program as its prefill calls.
    cache = qn.init_cache(cfg, prompt.shape[0], PROMPT_LEN + NEW_TOKENS)
    got = []
    for lo, hi in ((0, 35), (35, PROMPT_LEN)):
        length = np.full(prompt.shape[0], hi - lo, np.int32)
        logits, cache = qn.dense_forward(cfg, params, cache, prompt[:, lo:hi], length, chunk_size=CHUNK)
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    tokens = qn.generate(cfg, params, prompt, NEW_TOKENS, prefill_chunks=2, chunk_size=CHUNK)
    assert len(set(tokens[0].tolist())) > 3, "degenerate greedy run: the test would not see a wrong token"
    np.testing.assert_array_equal(tokens, want_tokens)


@pytest.mark.parametrize("hybrid", ["Qwen3_5ForCausalLM"], indirect=True)
def test_pallas_decode_matches_transformers(hybrid):
    # The GDN decode steps through the Pallas kernel (interpret mode here): same greedy tokens.
    # Three rows: the prefill program is the logits test's; only the decode step is new.
    path, model = hybrid
    prompt = _prompt(seed=2)
    with torch.no_grad():
        want = model.generate(torch.from_numpy(prompt).long(), max_new_tokens=NEW_TOKENS, do_sample=False,
                              min_new_tokens=NEW_TOKENS)[:, PROMPT_LEN:].numpy()
    cfg, params = qn.load(path)
    got = qn.generate(cfg, params, prompt, NEW_TOKENS, prefill_chunks=2, chunk_size=CHUNK, gdn_decode="pallas")
    np.testing.assert_array_equal(got, want)


def test_fused_expert_tensors_load_alike(tmp_path):
    # transformers 5's fused experts (mlp.experts.gate_up_proj [E, 2F, D], down_proj [E, D, F])
    # load to the same parameters as the per-expert tensors transformers 5.24 saves.
    from safetensors.numpy import load_file, save_file
    path = build("Qwen3NextForCausalLM", str(tmp_path / "per_expert"))
    _, want = qn.load(path)
    tensors = load_file(f"{path}/model.safetensors")
    fused = {n: a for n, a in tensors.items() if ".mlp.experts." not in n}
    E = MOE["num_experts"]
    for i in range(COMMON["num_hidden_layers"]):
        pre = f"model.layers.{i}.mlp.experts"
        if f"{pre}.0.gate_proj.weight" in tensors:
            fused[f"{pre}.gate_up_proj"] = np.stack([
                np.concatenate([tensors[f"{pre}.{e}.gate_proj.weight"], tensors[f"{pre}.{e}.up_proj.weight"]])
                for e in range(E)])
            fused[f"{pre}.down_proj"] = np.stack([tensors[f"{pre}.{e}.down_proj.weight"] for e in range(E)])
    out = tmp_path / "fused"
    out.mkdir()
    for f in os.listdir(path):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(path, f), out)
    save_file(fused, str(out / "model.safetensors"), metadata={"format": "pt"})
    _, got = qn.load(str(out))
    assert sum("experts_gate" in lp for lp in got["layers"]) == 4
    for lw, lg in zip(want["layers"], got["layers"]):
        assert lw.keys() == lg.keys()
        for n in lw:
            np.testing.assert_array_equal(lg[n], lw[n])


def test_config_reads_the_family(hybrid):
    path, model = hybrid
    cfg, params = qn.load(path)
    arch = model.config.architectures[0]
    assert cfg.architecture == arch
    assert cfg.rotary_dim == 4 and cfg.layer_types.count("linear_attention") == 3
    assert cfg.moe_layers == {"Qwen3NextForCausalLM": (True, True, False, True, True),
                              "Qwen3_5ForCausalLM": (False,) * 5,
                              "Qwen3_5MoeForCausalLM": (True,) * 5}[arch]
    # conv [3, 64] + delta [4, 16, 8] floats per GDN layer, 3 GDN layers
    assert cfg.state_bytes() == 3 * 4 * (3 * (2 * 32 + 32) + 4 * 16 * 8)
    kinds = [("in_qkv" in lp or "in_qkvz" in lp, "q" in lp, "router" in lp) for lp in params["layers"]]
    assert [k[0] for k in kinds] == [True, False, True, True, False]
    assert [k[1] for k in kinds] == [False, True, False, False, True]


@pytest.mark.parametrize("field,value,match", [
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
    ("attention_bias", True, "attention_bias"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, "rope_type 'linear'"),
])
def test_unsupported_options_refused_by_name(tmp_path, field, value, match):
    path = build("Qwen3_5ForCausalLM", str(tmp_path), **{field: value})
    with pytest.raises(ModelLoadError, match=match):
        qn.load(path)


def test_missing_and_unexpected_tensors_named(tmp_path):
    from safetensors.numpy import load_file, save_file
    path = build("Qwen3_5ForCausalLM", str(tmp_path))
    f = f"{path}/model.safetensors"
    tensors = load_file(f)
    tensors.pop("model.layers.1.self_attn.q_norm.weight")
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model.layers.1.self_attn.q_norm.weight'"):
        qn.load(path)
    tensors["model.layers.1.self_attn.q_norm.weight"] = np.zeros(16, np.float32)
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.zeros(16, np.float32)   # a GDN layer has none
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"):
        qn.load(path)


@pytest.mark.parametrize("hybrid", ["Qwen3NextForCausalLM"], indirect=True)
def test_ragged_batch_equals_transformers_solo(hybrid):
    # Three prompts of different lengths batched (padded at the end, two prefill calls in
    # which the short ones end early and then pad): each row's 32 greedy tokens equal
    # transformers' generate on that prompt alone.  (Qwen3-Next: MoE, dense and fused projections.)
    # BATCH rows of at most PROMPT_LEN tokens: the programs of the logits test (cache hits).
    path, model = hybrid
    cfg, params = qn.load(path)
    r = np.random.default_rng(3)
    prompts = [r.integers(0, VOCAB, n).astype(np.int32) for n in (PROMPT_LEN, 41, 17)]
    got = qn.generate(cfg, params, prompts, NEW_TOKENS, prefill_chunks=2, chunk_size=CHUNK)
    for p, row in zip(prompts, got):
        with torch.no_grad():
            want = model.generate(torch.from_numpy(p[None]).long(), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  min_new_tokens=NEW_TOKENS)[0, len(p):].numpy()
        np.testing.assert_array_equal(row, want)

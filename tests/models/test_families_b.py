"""Phi-3, SmolLM3, OLMo 2/3, Granite and GLM-4-MoE against transformers (models/families_b.py).

For a tiny random-weight checkpoint of each (``tiny_models.VARIANTS_B``: every distinguishing
option on) on the three attention paths (XLA, the native CPU kernels with the native matmul,
the Pallas kernel in interpret mode): float32 prompt logits through the paged cache within
1e-4 relative of transformers; and 32 greedy tokens from the engine identical to
``generate``, on one attention path per family (rotated, each path for two families).
Phi-3's LongRoPE is checked on both sides of ``original_max_position_embeddings`` (32): a
prompt that fits (short factors), one that does not (long factors), and decodes that cross it.  Then loading: a missing or misshapen fused tensor fails naming it, GLM-4-MoE's
multi-token-prediction layer is skipped as transformers skips it, and options the engine does
not implement are refused naming the option.  tp=2 on simulated devices: test_families_b_tp.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import weakref

import numpy as np
import pytest
import torch
from support.engines import ONE_SHOT_ENGINE, SMALL_ENGINE
from safetensors.numpy import load_file, save_file
from support.tiny_families import hf_greedy
from support.tiny_models import VARIANTS_B, build_tiny, load_hf, paged_logits

from jaxllm import LLM, SamplingParams
from jaxllm.errors import ModelLoadError
from jaxllm.models.loader import load_model

# (scan_layers, matmul, attention); GLM-4-MoE's layers (dense first) and OLMo 3's (sliding and full) differ,
# so they are never scanned.
BACKENDS = {"xla": (False, "xla", "xla"), "native": (False, "native", "native"), "pallas": (True, "xla", "pallas")}


def _backends():
    from jaxllm.cpu import native
    return sorted(BACKENDS) if native.available() else ["pallas", "xla"]


def prompt_ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 5000, size=n).tolist()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, smollm_tokenizer_dir):
    root = tmp_path_factory.mktemp("families_b")
    return {name: build_tiny(name, str(root / name), smollm_tokenizer_dir) for name in VARIANTS_B}


@pytest.fixture(scope="module")
def hf_models(ckpts):
    return {name: load_hf(path) for name, path in ckpts.items()}


@pytest.fixture(scope="module")
def engines(ckpts):
    """One engine per (variant, scan, attention, matmul) for the module: the LongRoPE crossing
    test runs on the greedy sweep's Phi-3 XLA engine instead of building its own."""
    made = {}

    def get(variant, scan, attention, matmul):
        key = (variant, scan, attention, matmul)
        if key not in made:
            made[key] = _engine(ckpts[variant], scan, attention, matmul)
        return made[key]
    yield get
    made.clear()


_REF_LOGITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> {ids: logits}


def _ref_logits(hf, ids):
    """transformers' float32 logits of ``ids``, once per model and prompt (the three backends
    compare with the same reference)."""
    refs = _REF_LOGITS.setdefault(hf, {})
    if tuple(ids) not in refs:
        with torch.no_grad():
            refs[tuple(ids)] = hf(torch.tensor([ids])).logits[0].numpy()
    return refs[tuple(ids)]


def _scan(variant: str, scan: bool) -> bool:
    return scan and variant not in ("glm4_moe", "olmo3")   # layers that differ run unrolled


# Prompt length and chunk split: 40 tokens crosses OLMo 3's window of 16 in both chunks; both
# chunks of Phi-3's end past 32 positions (long factors, as transformers' one forward over 40
# tokens); the 24-token prompt stays within them (short factors).
CASES = [(v, 40, 35) for v in sorted(VARIANTS_B)] + [("phi3", 24, 10)]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("variant,n,split", CASES, ids=[f"{v}-{n}" for v, n, _ in CASES])
def test_prompt_logits_match_transformers(variant, n, split, backend, ckpts, hf_models):
    scan, matmul, attention = BACKENDS[backend]
    ids = prompt_ids(n, seed=1)
    ours = paged_logits(ckpts[variant], ids, _scan(variant, scan), split=split, matmul=matmul, attention=attention)
    ref = _ref_logits(hf_models[variant], ids)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"{variant} ({backend}): max relative logit error {rel:.2e}"


def test_longrope_factors_are_chosen_by_sequence_length(ckpts, hf_models):
    # The two regimes really differ (else the checks above could not tell them apart), and
    # the prefix of a long prompt is not the short prompt's: transformers re-encodes all of it.
    long_ids = prompt_ids(40, seed=1)
    a, b = _ref_logits(hf_models["phi3"], long_ids[:24]), _ref_logits(hf_models["phi3"], long_ids)[:24]
    assert np.abs(a - b).max() > 1e-2 * np.abs(a).max()


# The greedy engine runs on one backend per family, rotated so that each backend generates end to
# end for two families (Phi-3 on XLA: its engine is also test_longrope_crossing_keeps_the_cached_keys').
# Every family's kernel features (OLMo 3's sliding window, GLM-4-MoE's experts, Phi-3's LongRoPE,
# Granite's scales, the QK norms) reach every backend in test_prompt_logits_match_transformers,
# which runs the full family x backend matrix through the paged cache in two chunks; the dropped
# greedy cells add only the decode step of the same kernels, which the rotated cells run per backend.
GREEDY_BACKEND = {"glm4_moe": "native", "granite": "pallas", "olmo2": "xla",
                  "olmo3": "native", "phi3": "xla", "smollm3": "pallas"}


def _greedy_backend(variant: str) -> str:
    backend = GREEDY_BACKEND[variant]
    return backend if backend in _backends() else "xla"   # no native build: XLA instead


@pytest.mark.parametrize("variant", sorted(VARIANTS_B), ids=[f"{v}-{GREEDY_BACKEND[v]}" for v in sorted(VARIANTS_B)])
def test_greedy_tokens_match_transformers(variant, engines, hf_models):
    backend = _greedy_backend(variant)
    scan, matmul, attention = BACKENDS[backend]
    # Prompts in one chunk each.  Phi-3's are all longer than 32 tokens: long factors from the
    # first step on, as in transformers' generate (shorter ones that cross 32 while decoding:
    # test_longrope_crossing_keeps_the_cached_keys).
    llm = engines(variant, _scan(variant, scan), attention, matmul)
    # Phi-3's run one at a time (see below), so two lengths past 32 hold what three did.  The
    # others' two fit one step (61 tokens: the 64-token bucket), then two rows decode: two
    # programs per engine (OLMo 3's window of 16 is crossed by both prompts).
    prompts = [prompt_ids(n, seed=10 + n) for n in ((33, 47) if variant == "phi3" else (21, 40))]
    # Phi-3's one at a time: together they would not fit one step's 64 tokens, and a chunked
    # prompt's first chunk would take the short factors.
    batches = [[p] for p in prompts] if variant == "phi3" else [prompts]
    outs = [o for b in batches for o in llm.generate(
        [{"prompt_token_ids": p} for p in b], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
        use_tqdm=False)]
    for p, out in zip(prompts, outs):
        # transformers' generate, once per prompt (tiny_families.hf_greedy)
        ref = hf_greedy(hf_models[variant], p, 32)
        assert out.outputs[0].token_ids == ref, f"{variant} ({backend}), prompt of {len(p)} tokens"


def _engine(path, scan, attention, matmul):
    # Only the buckets the steps run are compiled (this module is about what the engines
    # compute; every-bucket warm-up is tests/runner/test_compile.py's); the strict guard still
    # fails a step that compiles a bucket already made.
    return LLM(path, scan_layers=scan, attention_backend=attention, cpu_matmul=matmul,
               **{**ONE_SHOT_ENGINE, "max_num_batched_tokens": 64, "max_model_len": 128})


def _hf_greedy_with_cache(hf, prompt, n):
    """Greedy decoding through transformers' forward and its KV cache, without generate():
    Phi-3's generate() drops the cache and re-encodes the whole sequence with the long factors
    when it grows past original_max_position_embeddings; the forward keeps the keys it cached."""
    ids, out, past = list(prompt), [], None
    with torch.no_grad():
        step = torch.tensor([ids])
        for _ in range(n):
            o = hf(step, past_key_values=past, use_cache=True)
            past = o.past_key_values
            out.append(int(o.logits[0, -1].argmax()))
            step = torch.tensor([[out[-1]]])
    return out


def test_longrope_crossing_keeps_the_cached_keys(engines, hf_models):
    # A sequence that grows past 32 positions while decoding: each step takes the long factors
    # from the step its length passes 32 on, the keys cached before keep the short ones (no
    # re-encoding), and sequences of the batch choose independently: the prompt of 21 crosses
    # 32 while the one of 40 decodes beside it on the long factors (one prefill step of 61
    # tokens, then two rows: the greedy test's 64-token bucket and one more program).
    llm = engines("phi3", False, "xla", "xla")
    prompts = [prompt_ids(n, seed=10 + n) for n in (21, 40)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy_with_cache(hf_models["phi3"], p, 32), f"prompt of {len(p)}"


def test_glm4_moe_layers_are_not_scanned(ckpts):
    with pytest.raises(ValueError, match="--no-scan-layers"):
        LLM(ckpts["glm4_moe"], scan_layers=True, **SMALL_ENGINE)


# ------------------------------------------------------------------ loading


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _rewrite(path: str, fn) -> None:
    f = os.path.join(path, "model.safetensors")
    save_file(fn(load_file(f)), f, metadata={"format": "pt"})


def _edit_config(path: str, **changes) -> None:
    f = os.path.join(path, "config.json")
    with open(f) as fh:
        cfg = json.load(fh)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(f, "w") as fh:
        json.dump(cfg, fh)


@pytest.mark.parametrize("variant,drop", [
    ("phi3", "model.layers.1.self_attn.qkv_proj.weight"),
    ("phi3", "model.layers.0.mlp.gate_up_proj.weight"),
    ("glm4_moe", "model.layers.2.mlp.gate.e_score_correction_bias"),
    ("glm4_moe", "model.layers.1.mlp.shared_experts.down_proj.weight"),
    ("olmo2", "model.layers.1.post_feedforward_layernorm.weight"),
    ("olmo2", "model.layers.0.self_attn.k_norm.weight"),
])
def test_missing_tensor_is_named(variant, drop, ckpts, tmp_path):
    path = _copy(ckpts[variant], tmp_path / "ckpt")
    _rewrite(path, lambda t: {k: v for k, v in t.items() if k != drop})
    with pytest.raises(ModelLoadError, match=re.escape(f"missing tensor '{drop}'")):
        load_model(path)


def test_fused_qkv_is_split_at_load(ckpts):
    m = load_model(ckpts["phi3"])
    t = load_file(os.path.join(ckpts["phi3"], "model.safetensors"))
    a = m.arch
    qkv = t["model.layers.1.self_attn.qkv_proj.weight"]
    np.testing.assert_array_equal(m.layers[1]["k"], qkv[a.q_size:a.q_size + a.kv_size])
    np.testing.assert_array_equal(m.layers[1]["v"], qkv[a.q_size + a.kv_size:])
    gate_up = t["model.layers.0.mlp.gate_up_proj.weight"]
    np.testing.assert_array_equal(m.layers[0]["up"], gate_up[a.intermediate_size:])


def test_misshapen_fused_qkv_is_named(ckpts, tmp_path):
    path = _copy(ckpts["phi3"], tmp_path / "ckpt")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    _rewrite(path, lambda t: {**t, name: t[name][:-16]})
    with pytest.raises(ModelLoadError, match=re.escape(f"tensor '{name}'") + ".*shape"):
        load_model(path)


def test_unfused_projections_in_a_phi3_checkpoint_are_refused(ckpts, tmp_path):
    path = _copy(ckpts["phi3"], tmp_path / "ckpt")
    _rewrite(path, lambda t: {**t, "model.layers.0.self_attn.q_proj.weight": np.zeros((64, 64), np.float32)})
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.weight'"):
        load_model(path)


def test_dense_and_moe_layers_take_only_their_own_tensors(ckpts, tmp_path):
    path = _copy(ckpts["glm4_moe"], tmp_path / "ckpt")
    _rewrite(path, lambda t: {**t, "model.layers.0.mlp.gate.weight": np.zeros((8, 64), np.float32)})
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.layers.0.mlp.gate.weight'"):
        load_model(path)


def test_glm4_moe_mtp_layer_is_skipped(ckpts, tmp_path):
    # GLM-4.5 checkpoints carry a multi-token-prediction layer after the last decoder layer;
    # transformers skips it, and so does the loader (only as many layers as the config says).
    path = _copy(ckpts["glm4_moe"], tmp_path / "ckpt")
    _rewrite(path, lambda t: {**t, "model.layers.3.eh_proj.weight": np.zeros((64, 128), np.float32)})
    _edit_config(path, num_nextn_predict_layers=1)
    ref = load_model(ckpts["glm4_moe"])
    assert load_model(path).arch == ref.arch
    _edit_config(path, num_nextn_predict_layers=0)
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.layers.3.eh_proj.weight'"):
        load_model(path)


@pytest.mark.parametrize("variant,changes,option", [
    # SmolLM3's sliding NoPE layers.
    ("smollm3", dict(use_sliding_window=True, sliding_window=16, layer_types=None), "layer_types"),
    ("olmo3", dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                            "full_attention": {"rope_type": "default", "rope_theta": 5e5}}),
     "rope_parameters"),
    ("granite", dict(mlp_bias=True), "mlp_bias"),
    ("phi3", dict(hidden_act="gelu_new"), "hidden_act"),
    ("glm4_moe", dict(n_group=3), "n_group"),
    ("glm4_moe", dict(n_group=8, topk_group=4), "n_group"),
    ("glm4_moe", dict(topk_group=5), "topk_group"),
    ("glm4_moe", dict(topk_group=1, num_experts_per_tok=3), "num_experts_per_tok"),
])
def test_unsupported_option_is_refused(variant, changes, option, ckpts, tmp_path):
    path = _copy(ckpts[variant], tmp_path / "ckpt")
    _edit_config(path, **changes)
    with pytest.raises(ModelLoadError, match=option):
        load_model(path)


def test_olmo3_layer_types(ckpts, tmp_path):
    """OLMo 3's per-layer windows: the sliding layers take ``sliding_window``, the full ones
    none (the logits and greedy sweeps above run the mixed pattern against transformers); a
    window that never cuts anything within the context makes every layer full attention."""
    arch = load_model(ckpts["olmo3"]).arch
    assert [arch.window(i) for i in range(arch.num_layers)] == [16, None] and not arch.uniform_layers
    path = _copy(ckpts["olmo3"], tmp_path / "ckpt")
    _edit_config(path, sliding_window=512)
    arch = load_model(path).arch
    assert [arch.window(i) for i in range(arch.num_layers)] == [None, None] and arch.uniform_layers

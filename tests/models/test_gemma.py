"""Gemma 2 and Gemma 3 (text) against transformers on CPU, in float32.

Tiny random-weight checkpoints with every distinguishing option on (tests/support/tiny_families.py):
windows of 8 crossed by a 40-token prompt, soft caps, ``query_pre_attn_scalar``, Gemma 3's
two RoPE bases and q/k norm.  The prompt's logits through the paged cache (two chunks, a
permuted block table) within 1e-4 of transformers on the XLA path, the native CPU kernels
and the Pallas kernels in interpret mode; 32 greedy tokens equal to ``generate`` from the
engine on one backend per family; prefix caching on/off and preemption on Gemma 3; config spellings and
refusals; a load error naming a missing tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support.engines import SMALL_ENGINE
from support.tiny_families import backend_ids, backends, copy_checkpoint, hf_bf16_error, hf_greedy, prompt_ids
from support.tiny_families import family_checkpoints  # noqa: F401  (fixture)
from support.tiny_models import load_hf, paged_logits

from jaxllm import LLM, SamplingParams
from jaxllm.errors import ModelLoadError

GEMMAS = ("gemma2", "gemma3")


@pytest.fixture(scope="module")
def hf_gemmas(family_checkpoints):  # noqa: F811
    return {name: load_hf(family_checkpoints[name]) for name in GEMMAS}


@pytest.mark.parametrize("matmul,attention", backends(), ids=backend_ids())
@pytest.mark.parametrize("variant", GEMMAS)
def test_prompt_logits_match_transformers(variant, matmul, attention, family_checkpoints, hf_gemmas):  # noqa: F811
    ids = prompt_ids(40, seed=1)
    ours = paged_logits(family_checkpoints[variant], ids, False, split=20, matmul=matmul, attention=attention)
    with torch.no_grad():
        ref = hf_gemmas[variant](torch.tensor([ids])).logits[0].numpy()
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"{variant} ({matmul}, {attention}): max relative logit error {rel:.2e}"


GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _greedy_cases() -> list[tuple[str, str, str]]:
    """One backend per family (an engine each costs its compiles): Gemma 2 on the XLA path,
    Gemma 3 on the default CPU backends (the native kernels; XLA where they are unavailable)
    on the engine the prefix-caching and preemption tests share.  Soft caps, windows and
    ``query_pre_attn_scalar`` reach every backend, the Pallas kernels included, in
    ``test_prompt_logits_match_transformers`` (both families x every backend); the Pallas
    kernels (interpret mode: the costliest engine to compile) run end to end for Granite and
    SmolLM3 (test_families_b.py), and Gemma 2's soft cap and window decode 32 greedy tokens
    on the Pallas kernel per device at tp=2 (tests/parallel/test_tp_families.py)."""
    native = ("native", "native") if ("native", "native") in backends() else ("xla", "xla")
    return [("gemma2", "xla", "xla"), ("gemma3", *native)]


@pytest.mark.parametrize("variant,matmul,attention", _greedy_cases(),
                         ids=[f"{v}-{m}-{a}" for v, m, a in _greedy_cases()])
def test_greedy_tokens_match_transformers(variant, matmul, attention, family_checkpoints, hf_gemmas,  # noqa: F811
                                          request):
    if variant == "gemma3":
        # The small pool's engine (its default backends are these): the 40-token prompt in two
        # chunks of its 32-token budget, the steps the prefix-caching test's first request runs.
        llm = request.getfixturevalue("small_pool_gemma3")
    else:
        # One prompt past the windows, prefilled in one step (the paged-logits test covers
        # chunked prefill): two programs to build.
        llm = LLM(family_checkpoints[variant], cpu_matmul=matmul, attention_backend=attention,
                  **{**SMALL_ENGINE, "precompile": "auto", "max_num_batched_tokens": 64})
    assert llm.llm_engine.core.runner.cfg.kernels.attention == attention
    assert llm.llm_engine.core.runner.cfg.kernels.matmul == matmul
    prompts = [prompt_ids(40, seed=50)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_gemmas[variant], p), f"{variant}, prompt of {len(p)}"


@pytest.fixture(scope="module")
def small_pool_gemma3(family_checkpoints):  # noqa: F811
    """Gemma 3 on the default CPU backends with a pool of 10 blocks of 16: one 128-token
    sequence fits, four running at once do not.  The greedy test's Gemma 3 cell shares it."""
    return LLM(family_checkpoints["gemma3"], **{**SMALL_ENGINE, "num_blocks_override": 10, "max_model_len": 128,
                                                "precompile": "auto"})


def test_prefix_caching_on_and_off_equal(small_pool_gemma3):
    llm = small_pool_gemma3
    rng = np.random.default_rng(3)
    base = rng.integers(3, 5000, size=40).tolist()
    # Shared prefixes past the window (8): a cached block's K/V is read by later tokens' windows.
    prompts = [base[:32] + rng.integers(3, 5000, size=9).tolist(), base[:16] + rng.integers(3, 5000, size=5).tolist(),
               base]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate([{"prompt_token_ids": base}], params, use_tqdm=False)
    on = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    kv = llm.llm_engine.core.kv_manager
    kv.enable_prefix_caching = False
    try:
        off = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        kv.enable_prefix_caching = True
    assert [o.num_cached_tokens for o in on] == [32, 16, 32]
    assert [o.num_cached_tokens for o in off] == [0, 0, 0]
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]


def test_preemption_keeps_outputs_equal(small_pool_gemma3):
    llm = small_pool_gemma3
    rng = np.random.default_rng(4)
    prompts = [{"prompt_token_ids": rng.integers(3, 5000, size=int(n)).tolist()} for n in (30, 45, 20, 60, 12, 38)]
    # 205 prompt tokens and 24 each to decode: past the 160-token pool (asserted below).
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    solo = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    core = llm.llm_engine.core
    before = core.scheduler.num_preemptions
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert core.scheduler.num_preemptions > before
    assert [o.outputs[0].token_ids for o in outs] == solo
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


# ----------------------------------------------------------------------------- config and loading

def test_arch_configs(family_checkpoints):  # noqa: F811
    from jaxllm.models.loader import load_model
    g2 = load_model(family_checkpoints["gemma2"]).arch
    assert g2.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert [g2.window(i) for i in range(3)] == [8, None, 8]
    assert (g2.gemma.attn_soft_cap, g2.gemma.final_soft_cap, g2.qk_norm, g2.gemma.rope_local_theta) == (5.0, 10.0, False, None)
    assert g2.attn_scale == pytest.approx(24 ** -0.5)
    g3 = load_model(family_checkpoints["gemma3"])
    a = g3.arch
    assert [a.window(i) for i in range(4)] == [8, 8, None, 8] and a.qk_norm and a.gemma.attn_soft_cap is None
    assert (a.rope_theta, a.gemma.rope_local_theta, a.rope_scaling.rope_type, a.rope_scaling.factor) == (
        1e6, 1e4, "linear", 4.0)
    # The local table is the default rope of base 1e4, the global one base 1e6 over 4.
    half = a.head_dim // 2
    np.testing.assert_allclose(g3.rope_tables["rope_local_inv_freq"], 1e4 ** -(np.arange(half) * 2 / a.head_dim),
                               rtol=1e-6)
    np.testing.assert_allclose(g3.rope_inv_freq, 1e6 ** -(np.arange(half) * 2 / a.head_dim) / 4, rtol=1e-6)


def test_gemma3_legacy_spelling_reads_the_same(family_checkpoints, tmp_path):  # noqa: F811
    """transformers writes Gemma 3's rope both ways: per-layer-type ``rope_parameters``, or the
    older top-level ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` with a
    ``sliding_window_pattern``.  Both read to the same ArchConfig."""
    from jaxllm.models.loader import load_model

    def legacy(cfg):
        cfg.pop("rope_parameters")
        cfg.pop("layer_types")
        cfg.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 4.0},
                   sliding_window_pattern=3, num_hidden_layers=4)
    path = copy_checkpoint(family_checkpoints["gemma3"], str(tmp_path / "legacy"), legacy)
    a = load_model(path).arch
    b = load_model(family_checkpoints["gemma3"]).arch
    # Pattern 3: every third layer global.
    assert a.layer_types == ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")
    assert a == b


@pytest.mark.parametrize("field,value,match", [
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("hidden_activation", "relu", "hidden_activation"),
    ("rope_parameters", {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}}, "rope_type"),
    ("rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}, "dynamic"),
])
def test_unsupported_options_are_refused_by_name(field, value, match, family_checkpoints, tmp_path):  # noqa: F811
    from jaxllm.models.loader import load_model
    path = copy_checkpoint(family_checkpoints["gemma3"], str(tmp_path / "bad"), lambda c: c.update({field: value}))
    with pytest.raises(ModelLoadError, match=match):
        load_model(path)


@pytest.mark.parametrize("variant,tensor", [("gemma3", "model.layers.1.self_attn.q_norm.weight"),
                                            ("gemma2", "model.layers.2.pre_feedforward_layernorm.weight")])
def test_missing_tensor_is_named(variant, tensor, family_checkpoints, tmp_path):  # noqa: F811
    from jaxllm.models.loader import load_model
    path = copy_checkpoint(family_checkpoints[variant], str(tmp_path / "missing"), drop=tensor)
    with pytest.raises(ModelLoadError, match=f"missing tensor '{tensor}'"):
        load_model(path)


def test_scan_layers_is_refused_for_mixed_layers(family_checkpoints):  # noqa: F811
    with pytest.raises(ValueError, match="--scan-layers"):
        LLM(family_checkpoints["gemma2"], scan_layers=True, **SMALL_ENGINE)


def test_uniform_layers_run_under_scan(family_checkpoints, tmp_path):  # noqa: F811
    """A checkpoint whose layers are all alike (every layer sliding) may be stacked under
    lax.scan: the same logits as transformers."""
    def all_sliding(cfg):
        cfg["layer_types"] = ["sliding_attention"] * cfg["num_hidden_layers"]
    path = copy_checkpoint(family_checkpoints["gemma3"], str(tmp_path / "uniform"), all_sliding)
    ids = prompt_ids(40, seed=5)
    ours = paged_logits(path, ids, True, split=20)
    with torch.no_grad():
        ref = load_hf(path)(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4


@pytest.mark.parametrize("variant", GEMMAS)
def test_bf16_weights_and_cache_stay_close(variant, family_checkpoints, hf_gemmas):  # noqa: F811
    # bf16 weights and cache (packed bits on CPU) with the native kernels: the model's function
    # to bf16 precision.
    matmul = "native" if backends()[1:2] == [("native", "native")] else "xla"
    ids = prompt_ids(40, seed=2)
    ours = paged_logits(family_checkpoints[variant], ids, False, split=20, matmul=matmul, attention=matmul,
                        bf16=True)
    with torch.no_grad():
        ref = hf_gemmas[variant](torch.tensor([ids])).logits[0].numpy()
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    # No worse than transformers' own bf16 run of the model (activations stay float32 here).
    bound = max(3e-2, hf_bf16_error(family_checkpoints[variant], ids, ref))
    assert rel < bound, f"{variant} bf16 max relative logit error {rel:.2e} (transformers' bf16: {bound:.2e})"

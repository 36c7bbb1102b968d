"""GPT-OSS against transformers on CPU, in float32.

A tiny random-weight checkpoint (tests/support/tiny_families.py) with sinks, alternating windows of
8 (crossed by the 40-token prompt), q/k/v/o biases, 4 biased experts with a SwiGLU limit the
activations reach, and YaRN: the prompt's logits through the paged cache within 1e-4 of
transformers on the XLA path, the native CPU kernels and the Pallas kernels (interpret);
32 greedy tokens equal to ``generate`` from the engine on the default CPU backends, whose engine
also runs prefix caching on/off and preemption; YaRN's frequencies against transformers'; refusals and a missing sink named.
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


@pytest.fixture(scope="module")
def ckpt(family_checkpoints):  # noqa: F811
    return family_checkpoints["gpt_oss"]


@pytest.fixture(scope="module")
def hf_model(ckpt):
    return load_hf(ckpt)


@pytest.mark.parametrize("matmul,attention", backends(), ids=backend_ids())
def test_prompt_logits_match_transformers(matmul, attention, ckpt, hf_model):
    ids = prompt_ids(40, seed=1)
    ours = paged_logits(ckpt, ids, False, split=20, matmul=matmul, attention=attention)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"gpt_oss ({matmul}, {attention}): max relative logit error {rel:.2e}"


@pytest.fixture(scope="module")
def small_pool(ckpt):
    """The default CPU backends with a pool of 10 blocks of 16: one 128-token sequence fits,
    four running at once do not.  The greedy, prefix-caching and preemption tests share it
    (one engine: the buckets its steps run, compiled once)."""
    return LLM(ckpt, **{**SMALL_ENGINE, "num_blocks_override": 10, "max_model_len": 128, "precompile": "auto"})


GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


# End to end on the default CPU backends, on the engine the prefix-caching and preemption tests
# share (a Pallas engine of its own cost this file a quarter of its time in compiles). The
# sinks, windows, biased experts and YaRN reach every backend, the Pallas kernels included, in
# test_prompt_logits_match_transformers (the paged cache over two chunks), and the sinks decode
# 32 greedy tokens on the Pallas kernel per device at tp=2 (tests/parallel/test_tp_families.py);
# the Pallas kernels run end to end in an engine for Granite and SmolLM3 (test_families_b.py).
def test_greedy_tokens_match_transformers(small_pool, hf_model):
    # One prompt past the windows, prefilled in two chunks of the 32-token budget: the steps
    # the prefix-caching test's first request runs.
    prompt = prompt_ids(40, seed=50)
    out = small_pool.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt), f"prompt of {len(prompt)}"


def test_prefix_caching_on_and_off_equal(small_pool):
    llm = small_pool
    rng = np.random.default_rng(3)
    base = rng.integers(3, 5000, size=40).tolist()
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
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]


def test_preemption_keeps_outputs_equal(small_pool):
    llm = small_pool
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

def test_arch_config_and_yarn_frequencies(ckpt, hf_model):
    from jaxllm.models.loader import load_model
    model = load_model(ckpt)
    a = model.arch
    assert a.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size, a.qkv_bias, a.o_bias) == (4, 2, 32, True,
                                                                                                     True)
    assert (a.gpt_oss.swiglu_limit, a.gpt_oss.swiglu_alpha) == (1.5, pytest.approx(1.702))
    rot = hf_model.model.rotary_emb
    np.testing.assert_allclose(model.rope_inv_freq, rot.inv_freq.numpy(), rtol=1e-6)
    assert a.rope_scaling.rope_type == "yarn" and a.rope_scaling.attention_factor == pytest.approx(
        rot.attention_scaling)
    assert a.rope_scaling.attention_factor != 1.0


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4,
                                         "original_max_position_embeddings": 64}), "llama3"),
    (lambda c: c.update(quantization_config={"quant_method": "mxfp4"}), "mxfp4"),
], ids=["act", "rope", "mxfp4"])
def test_unsupported_options_are_refused_by_name(edit, match, ckpt, tmp_path):
    from jaxllm.models.loader import load_model
    path = copy_checkpoint(ckpt, str(tmp_path / "bad"), edit)
    with pytest.raises((ModelLoadError, ValueError), match=match):
        load_model(path)


@pytest.mark.parametrize("tensor", ["model.layers.1.self_attn.sinks", "model.layers.0.mlp.experts.down_proj_bias"])
def test_missing_tensor_is_named(tensor, ckpt, tmp_path):
    from jaxllm.models.loader import load_model
    path = copy_checkpoint(ckpt, str(tmp_path / "missing"), drop=tensor)
    with pytest.raises(ModelLoadError, match=f"missing tensor '{tensor}'"):
        load_model(path)


def test_uniform_layers_run_under_scan(ckpt, tmp_path):
    """Every layer global: the layers stack under lax.scan (the experts passed whole, sliced
    at the scanned layer's index), the same logits as transformers."""
    def all_full(cfg):
        cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    path = copy_checkpoint(ckpt, str(tmp_path / "uniform"), all_full)
    ids = prompt_ids(40, seed=5)
    ours = paged_logits(path, ids, True, split=20)
    with torch.no_grad():
        ref = load_hf(path)(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4


def test_bf16_weights_and_cache_stay_close(ckpt, hf_model):
    # bf16 weights (the experts sliced as bits, widened per expert) and cache with the native
    # kernels: the model's function to bf16 precision.
    matmul = "native" if backends()[1:2] == [("native", "native")] else "xla"
    ids = prompt_ids(40, seed=2)
    ours = paged_logits(ckpt, ids, False, split=20, matmul=matmul, attention=matmul, bf16=True)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    # No worse than transformers' own bf16 run of the model (activations stay float32 here).
    bound = max(3e-2, hf_bf16_error(ckpt, ids, ref))
    assert rel < bound, f"gpt_oss bf16 max relative logit error {rel:.2e} (transformers' bf16: {bound:.2e})"

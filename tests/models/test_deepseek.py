"""DeepSeek-V2 / V3 (multi-head latent attention, models/deepseek.py) against transformers.

Tiny random-weight checkpoints (``tiny_models.VARIANTS_MLA``): V2-Lite's shape (one q_proj,
greedy softmax routing, a dense first layer), V2 (low-rank q, group-limited routing, every
layer MoE, so it also runs under ``lax.scan``) and V3 (sigmoid grouped routing with the
correction bias, a dense first layer, interleaved YaRN rope with mscale).  Float32 prompt
logits through the paged latent cache over three prefill chunks within 1e-4 relative of
transformers on the XLA path, the native CPU kernels and the Pallas MLA kernel (interpret
mode), bf16 as the CPU stores it within transformers' own bf16 error; 32 greedy tokens from V3's engine equal to ``generate``; 16 requests batched
under a small token budget equal to each run alone, and preemption keeping outputs equal;
the latent cache's bytes read back from the device within the budget; the paged MLA
attention against its plain reference; options the engine does not implement refused by name.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from support.engines import SMALL_ENGINE
from support.tiny_families import copy_checkpoint, hf_greedy, prompt_ids
from support.tiny_models import VARIANTS_MLA, build_tiny, load_hf, paged_logits

from jaxllm import LLM, SamplingParams
from jaxllm.errors import ModelLoadError
from jaxllm.models.loader import load_model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, smollm_tokenizer_dir):
    root = tmp_path_factory.mktemp("deepseek")
    return {name: build_tiny(name, str(root / name), smollm_tokenizer_dir) for name in VARIANTS_MLA}


@pytest.fixture(scope="module")
def hf_models(ckpts):
    return {name: load_hf(path) for name, path in ckpts.items()}


def _ref_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


# (variant, scan_layers, kernels): V3 on the XLA path, the native CPU kernels (matmul and
# attention, the CPU default: XLA where they do not build) and the Pallas MLA kernel
# (interpret mode); V2 scanned on XLA and Pallas; V2-Lite on the CPU default.
CASES = [("deepseek_v3", False, "xla"), ("deepseek_v3", False, "native"), ("deepseek_v3", False, "pallas"),
         ("deepseek_v2", True, "xla"), ("deepseek_v2", True, "pallas"), ("deepseek_v2_lite", False, "native")]


@pytest.mark.parametrize("variant,scan,kernels", CASES,
                         ids=[f"{v}-{'scan' if s else 'unrolled'}-{k}" for v, s, k in CASES])
def test_prompt_logits_match_transformers(variant, scan, kernels, ckpts, hf_models):
    from jaxllm.cpu import native
    if kernels == "native" and not native.available():   # available() also registers the kernels
        kernels = "xla"
    matmul, attention = ("xla", kernels) if kernels == "pallas" else (kernels, kernels)
    ids = prompt_ids(45, seed=1)
    # Three prefill chunks of 15 (equal: one program per cell), each crossing a block of 16
    # but the first: the later ones attend to latents cached by the earlier ones.
    ours = paged_logits(ckpts[variant], ids, scan, split=(15, 30), matmul=matmul, attention=attention)
    ref = _ref_logits(hf_models[variant], ids)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"{variant} ({attention}): max relative logit error {rel:.2e}"


def test_config_reading(ckpts, hf_models):
    v3 = load_model(ckpts["deepseek_v3"])
    a = v3.arch
    assert (a.mla.kv_lora_rank, a.mla.q_lora_rank, a.mla.qk_nope_head_dim, a.head_dim, a.mla.v_head_dim) == (32, 24, 16, 8, 24)
    assert (a.moe.router_scoring, a.moe.n_group, a.moe.topk_group, a.moe.first_k_dense, a.moe.shared_experts) == ("sigmoid", 4, 2, 1, 1)
    assert a.mla.rope_interleave and a.norm_topk_prob and a.moe.routed_scaling_factor == 2.5
    attn = hf_models["deepseek_v3"].model.layers[0].self_attn
    assert a.attn_scale == pytest.approx(attn.scaling, rel=1e-6) and a.attn_scale != 24 ** -0.5   # mscale_all_dim
    rot = hf_models["deepseek_v3"].model.rotary_emb
    np.testing.assert_allclose(v3.rope_inv_freq, rot.inv_freq.numpy(), rtol=1e-6)
    assert a.rope_scaling.attention_factor == pytest.approx(rot.attention_scaling) != 1.0
    lite = load_model(ckpts["deepseek_v2_lite"]).arch
    assert (lite.mla.q_lora_rank, lite.moe.router_scoring, lite.norm_topk_prob, lite.moe.topk_method) == (0, "softmax", False,
                                                                                              "greedy")
    v2 = load_model(ckpts["deepseek_v2"]).arch
    assert (v2.moe.topk_method, v2.moe.n_group, v2.moe.topk_group, v2.uniform_layers) == ("group_limited_greedy", 4, 1, True)


def test_paged_mla_matches_its_reference():
    """Two sequences of 37 and 5 tokens, the longer one's blocks out of order, decoding and
    prefilling in one ragged step: the paged loop (chunked online softmax) against the plain
    softmax over each sequence's whole context."""
    import jax

    from jaxllm.layers.attention import AttentionMetadata
    from jaxllm.layers.mla_attention import mla_reference, paged_mla_xla, write_latent
    rng = np.random.default_rng(0)
    H, R, Dr, BS = 3, 16, 4, 4
    lens = (37, 5)
    tables = np.array([[9, 2, 7, 0, 4, 11, 3, 5, 12, 6], [1, 8, 0, 0, 0, 0, 0, 0, 0, 0]], np.int32)
    entries = [rng.standard_normal((n, R + Dr)).astype(np.float32) for n in lens]
    pages = jnp.zeros((13, BS, R + Dr), jnp.float32)
    for s, n in enumerate(lens):
        pos = np.arange(n)
        pages = write_latent(pages, None, jnp.asarray(tables[s, pos // BS] * BS + pos % BS), jnp.asarray(entries[s]))
    # This step: the last 3 tokens of sequence 0 (a prefill chunk) and the last of sequence 1 (a decode).
    positions = np.array([34, 35, 36, 4], np.int32)
    token_seq = np.array([0, 0, 0, 1], np.int32)
    md = AttentionMetadata(positions=positions, slot_mapping=np.zeros(4, np.int32), token_seq=token_seq,
                           block_tables=tables, seq_lens=np.array(lens, np.int32),
                           query_start_loc=np.array([0, 3, 4], np.int32))
    q = rng.standard_normal((4, H, R + Dr)).astype(np.float32)
    got = jax.jit(lambda q, p: paged_mla_xla(q, p, None, md, scale=0.3, latent_dim=R))(q, pages)
    for t in range(4):
        s = token_seq[t]
        want = mla_reference(q[t:t + 1], entries[s], positions[t:t + 1], scale=0.3, latent_dim=R)
        np.testing.assert_allclose(np.asarray(got[t:t + 1]), np.asarray(want), rtol=2e-5, atol=2e-6)


def _engine(path):
    """A pool of 12 blocks of 16 and 24 tokens a step: one 128-token sequence fits, many
    running at once do not (preemption), and longer prompts are prefilled in chunks.
    Buckets are compiled as steps need them (the strict guard still fails a ready one that
    compiles again): compiling every bucket up front would double this module's time."""
    return LLM(path, **{**SMALL_ENGINE, "num_blocks_override": 12, "max_num_batched_tokens": 24, "max_num_seqs": 8,
                        "max_model_len": 128, "precompile": "auto"})


@pytest.fixture(scope="module")
def engines(ckpts):
    return {v: _engine(ckpts[v]) for v in ("deepseek_v3",)}


# One engine per family: V3's, which the batching and preemption test shares (it compiles its
# every bucket, so these prompts prefill in chunks, 40 in a 24-token budget, at no extra
# compile).  V2 (low-rank q, group-limited routing, scanned layers) is held to transformers by
# test_prompt_logits_match_transformers (scanned, on the XLA path and the Pallas MLA kernel, over
# three chunks through the latent cache), and its engine decodes 32 greedy tokens in
# tests/parallel/test_mla_tp.py (tp=2 equal to one device); an engine of its own here cost this
# file a fifth of its time in compiles.
def test_greedy_tokens_match_transformers(engines, hf_models):
    variant = "deepseek_v3"
    prompts = [prompt_ids(n, seed=10 + n) for n in (5, 21, 40)]
    outs = engines[variant].generate([{"prompt_token_ids": p} for p in prompts],
                                     SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_models[variant], p), f"{variant}, prompt of {len(p)} tokens"


def test_batching_equals_solo_and_preemption_keeps_outputs_equal(engines):
    llm = engines["deepseek_v3"]
    rng = np.random.default_rng(4)
    prompts = [{"prompt_token_ids": rng.integers(3, 5000, size=int(n)).tolist()}
               for n in rng.integers(3, 60, size=8)]   # 8 x ~55 tokens: past the 192-token pool
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    solo = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    core = llm.llm_engine.core
    before = core.scheduler.num_preemptions
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert core.scheduler.num_preemptions > before, "precondition: the pool is too small for all of them"
    assert [o.outputs[0].token_ids for o in outs] == solo
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scan"])
@pytest.mark.parametrize("budget", [1 << 20, 3 * (1 << 20) + 12345])
def test_latent_cache_bytes_stay_within_the_budget(ckpts, scan_layers, budget):
    """Every latent page array the runner allocated, read back from the device: within the
    budget, and the budget used; a block counts the latent and rope key of every layer."""
    from jaxllm.config import EngineConfig
    from jaxllm.engine.resolve import resolve_config
    from jaxllm.runner.model_runner import ModelRunner
    model = load_model(ckpts["deepseek_v2"])        # uniform layers: both layouts
    a = model.arch
    cfg = EngineConfig.from_kwargs(kv_cache_memory_bytes=budget, max_model_len=128, dtype="float32")
    r = resolve_config(cfg, model)
    runner = ModelRunner(model, dataclasses.replace(r.step, scan_layers=scan_layers, max_logprobs=2),
                         num_blocks=r.kv.num_blocks, show_progress=False)
    nbytes = runner.kv_cache_bytes()
    assert nbytes == r.kv.total_bytes and nbytes <= budget
    assert budget - nbytes < r.kv.bytes_per_block
    assert r.kv.bytes_per_block == a.num_layers * r.kv.block_size * (a.mla.kv_lora_rank + a.head_dim) * 4
    assert "MLA latent + rope key 2 layers" in r.kv.describe(128)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(attention_bias=True), "attention_bias"),
    (lambda c: c.update(num_key_value_heads=2), "num_key_value_heads"),
    (lambda c: c.update(topk_method="noaux_tc"), "topk_method"),
    (lambda c: c.update(moe_layer_freq=2), "moe_layer_freq"),
    (lambda c: c.update(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4,
                                         "original_max_position_embeddings": 64}), "llama3"),
], ids=["act", "attention_bias", "kv_heads", "topk_method", "moe_layer_freq", "rope"])
def test_unsupported_options_are_refused_by_name(edit, match, ckpts, tmp_path):
    path = copy_checkpoint(ckpts["deepseek_v2"], str(tmp_path / "bad"), edit)
    with pytest.raises(ModelLoadError, match=match):
        load_model(path)


def test_quantized_kv_cache_is_refused(ckpts):
    with pytest.raises(ValueError, match="--kv-cache-dtype int8 is not supported for DeepseekV2ForCausalLM"):
        LLM(ckpts["deepseek_v2"], kv_cache_dtype="int8", **SMALL_ENGINE)


def test_bfloat16_on_cpu(ckpts, hf_models):
    """bf16 weights and latent cache as the CPU stores them (uint16 bit patterns), the native
    kernels: no worse than transformers' own bf16 run of the model."""
    from support.tiny_families import hf_bf16_error

    from jaxllm.cpu import native
    matmul = "native" if native.available() else "xla"      # available() also registers the kernels
    ids = prompt_ids(45, seed=1)
    ours = paged_logits(ckpts["deepseek_v3"], ids, False, split=(15, 30), matmul=matmul, attention=matmul, bf16=True)
    ref = _ref_logits(hf_models["deepseek_v3"], ids)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    bound = max(3e-2, hf_bf16_error(ckpts["deepseek_v3"], ids, ref))
    assert rel < bound, f"deepseek_v3 bf16 max relative logit error {rel:.2e} (transformers' bf16: {bound:.2e})"

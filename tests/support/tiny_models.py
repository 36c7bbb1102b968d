"""Tiny random-weight checkpoints of every registered architecture, built with transformers.

Each variant exercises one architectural feature (GQA, q/k/v bias, q/k norm, tied and
untied heads, llama3 / linear rope scaling, sliding window, mixture-of-experts MLPs with and
without renormalised routing weights).  Weights are drawn with a
larger-than-default spread so that greedy decoding has clear winners instead of near-ties.
"""

from __future__ import annotations

import itertools
import os

import numpy as np

VOCAB = 49152  # the SmolLM2 tokenizer is saved beside every tiny checkpoint

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)

VARIANTS = {
    # name: (config class name, overrides)
    "llama_gqa_untied": ("LlamaConfig", dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "llama3_rope_tied": ("LlamaConfig", dict(
        tie_word_embeddings=True, num_key_value_heads=1,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32, "rope_theta": 500000.0})),
    "llama_linear_rope_mha": ("LlamaConfig", dict(
        num_key_value_heads=4, tie_word_embeddings=False,
        rope_scaling={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    "mistral_sliding": ("MistralConfig", dict(sliding_window=16, tie_word_embeddings=False)),
    "qwen2_qkv_bias": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3_qk_norm": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False, num_key_value_heads=2)),
    # 8 experts, top-2, routing weights not renormalised (Qwen3-MoE's norm_topk_prob=false).
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=False, head_dim=32, num_hidden_layers=2,
                                         tie_word_embeddings=False)),
    # 4 experts, top-2, always renormalised; the saved config has "head_dim": null.
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                                      num_hidden_layers=2, tie_word_embeddings=False)),
}

MOE_VARIANTS = ("qwen3_moe", "mixtral")

# Config classes whose architecture is not their name with ForCausalLM for Config.
ARCHITECTURE_NAMES = {"Gemma3TextConfig": "Gemma3ForCausalLM"}

_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
             "short_factor": [1.0, 1.3, 2.1, 3.4], "long_factor": [1.7, 3.9, 6.2, 11.0],
             "original_max_position_embeddings": 32}

VARIANTS_B = {
    # The families of jaxllm/models/families_b.py, every distinguishing option on (built by
    # tests/models/test_families_b.py only, so the older sweeps stay as long as they were).
    # Phi-3: fused qkv / gate_up, LongRoPE switching at 32 positions, partial rotary (half of each head).
    "phi3": ("Phi3Config", dict(num_hidden_layers=2, tie_word_embeddings=False, original_max_position_embeddings=32,
                                rope_scaling=_LONGROPE)),
    # SmolLM3: layers 1 and 3 without RoPE, q/k/v/o biases.
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, no_rope_layer_interval=2, attention_bias=True, pad_token_id=0,
                                      tie_word_embeddings=True)),
    "olmo2": ("Olmo2Config", dict(num_hidden_layers=2, attention_bias=True, tie_word_embeddings=False)),
    # OLMo 3's interleaved pattern: a sliding layer (window 16) and a full one.
    "olmo3": ("Olmo3Config", dict(num_hidden_layers=2, sliding_window=16, tie_word_embeddings=False,
                                  layer_types=["sliding_attention", "full_attention"])),
    "granite": ("GraniteConfig", dict(num_hidden_layers=2, embedding_multiplier=4.0, residual_multiplier=0.5,
                                      attention_multiplier=0.5, logits_scaling=2.0, attention_bias=True,
                                      tie_word_embeddings=True)),
    # GLM-4-MoE: a dense first layer, 8 routed experts in 4 groups (best 2 eligible), top-2,
    # one shared expert, scaled weights, half-rotary heads, q/k/v bias, per-head q/k norm.
    "glm4_moe": ("Glm4MoeConfig", dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
                                       n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4,
                                       topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                       first_k_dense_replace=1, partial_rotary_factor=0.5, attention_bias=True,
                                       use_qk_norm=True, head_dim=16, tie_word_embeddings=False)),
}


# DeepSeek's YaRN: factor 4 over 64 original positions, with mscale and mscale_all_dim (the
# softmax scale's correction); unequal, so cos and sin carry an attention factor too.
_DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                  "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
_MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
            intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            max_position_embeddings=256, tie_word_embeddings=False)

VARIANTS_MLA = {
    # MLA (jaxllm/models/deepseek.py), built by tests/models/test_deepseek.py and the budget test.
    # V2-Lite's shape: one q_proj (q_lora_rank None), softmax greedy routing, a dense first layer.
    "deepseek_v2_lite": ("DeepseekV2Config", dict(_MLA, num_hidden_layers=2, q_lora_rank=None, topk_method="greedy",
                                                  n_shared_experts=2, first_k_dense_replace=1,
                                                  routed_scaling_factor=1.5, rope_parameters=_DEEPSEEK_YARN)),
    # V2: low-rank q with its norm, group-limited routing (4 groups of 2, both experts from the best one),
    # every layer MoE (scannable).
    "deepseek_v2": ("DeepseekV2Config", dict(_MLA, num_hidden_layers=2, q_lora_rank=24,
                                             topk_method="group_limited_greedy", n_group=4, topk_group=1,
                                             n_shared_experts=1, first_k_dense_replace=0, routed_scaling_factor=2.0,
                                             rope_parameters=_DEEPSEEK_YARN)),
    # V3: sigmoid grouped routing with the correction bias, renormalised and scaled; a dense
    # first layer; interleaved rope with YaRN.
    "deepseek_v3": ("DeepseekV3Config", dict(_MLA, num_hidden_layers=3, q_lora_rank=24, n_group=4, topk_group=2,
                                             n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                             norm_topk_prob=True, rope_parameters=_DEEPSEEK_YARN)),
}


def build_tiny(variant: str, out_dir: str, tokenizer_dir: str | None = None, seed: int = 0,
               variants: dict | None = None) -> str:
    """Writes an HF folder (config, safetensors, tokenizer) for ``variant`` (of ``variants``,
    default :data:`VARIANTS`); returns its path."""
    import torch
    import transformers

    cls_name, overrides = (variants or {**VARIANTS, **VARIANTS_B, **VARIANTS_MLA})[variant]
    cfg_cls = getattr(transformers, cls_name)
    cfg = cfg_cls(**{**BASE, **overrides})
    cfg.architectures = [ARCHITECTURE_NAMES.get(cls_name, cls_name.replace("Config", "ForCausalLM"))]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.5 / np.sqrt(p.shape[-1])))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # GLM-4-MoE's router bias (a saved buffer)
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer_dir is not None:
        for f in os.listdir(tokenizer_dir):
            src = os.path.join(tokenizer_dir, f)
            if os.path.isfile(src):
                with open(src, "rb") as a, open(os.path.join(out_dir, f), "wb") as b:
                    b.write(a.read())
    return out_dir


def load_hf(path: str):
    import torch
    import transformers
    # MoE experts: the eager per-expert loop, not transformers 5's default grouped_mm kernel.
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              experts_implementation="eager")
    model.eval()
    return model


def paged_logits(path, ids: list[int], scan_layers: bool, split: int, matmul: str = "xla",
                 bf16: bool = False, attention: str = "xla", block: int = 16,
                 quantization: str | None = None, kv_cache_dtype: str = "auto") -> np.ndarray:
    """Logits of every prompt position of the checkpoint at ``path`` (or a ``LoadedModel``),
    computed in two chunks [0, split) and [split, T) (``split`` a tuple: more chunks) through a paged cache whose block table
    is deliberately not in order, with the given matmul and attention backends (and
    ``--quantization``, ``--kv-cache-dtype``)."""
    import jax
    import jax.numpy as jnp

    from jaxllm.layers.attention import AttentionMetadata
    from jaxllm.models.kernels import Kernels
    from jaxllm.models.loader import load_model
    from jaxllm.models.registry import get_model_module
    from jaxllm.runner.weights import allocate_kv_cache, interleaved_types, to_device_params

    model = load_model(path, quantization=quantization) if isinstance(path, str) else path
    arch = model.arch
    # Laid out as the engine lays them out for the native matmul (fused projections, panels;
    # "native-int8": the int8-activation kernel, its weights interleaved where the CPU has VNNI;
    # "native-int16": Q4_1 weights by int16 activations, interleaved where the CPU has VNNI).
    int8, int16 = matmul == "native-int8", matmul == "native-int16"
    kernels = Kernels(matmul="native" if int8 or int16 else matmul, attention=attention, int8_activations=int8,
                      int16_activations=int16)
    params = to_device_params(model, jnp.bfloat16 if bf16 else jnp.float32, scan_layers, packed_bf16=bf16,
                              native=matmul in ("native", "native-int8", "native-int16"),
                              interleave=interleaved_types(kernels))
    T = len(ids)
    n_blocks = -(-T // block)
    num_blocks = n_blocks + 5
    table = np.random.default_rng(0).permutation(num_blocks)[:n_blocks].astype(np.int32)
    from jaxllm.layers import kv_quant
    kv_dtype = kv_quant.kv_format(kv_cache_dtype, "cpu") or (jnp.uint16 if bf16 else jnp.float32)
    module = get_model_module(arch.architecture)   # the family's forward (llama, gemma, ...)
    if hasattr(module, "allocate_cache"):          # a family's own cache (MLA's latent pages)
        kv = module.allocate_cache(arch, num_blocks, block, kv_dtype, stacked=scan_layers)
    else:
        kv = allocate_kv_cache(arch.num_layers, num_blocks, block, arch.num_kv_heads, arch.head_dim,
                               kv_dtype, stacked=scan_layers)
    fwd = jax.jit(lambda p, kv, ids, md: module.forward(arch, p, kv, ids, md, kernels))
    out = []
    bounds = [0, *((split,) if isinstance(split, int) else split), T]   # several chunks: a tuple of splits
    for lo, hi in itertools.pairwise(bounds):
        pos = np.arange(lo, hi, dtype=np.int32)
        md = AttentionMetadata(
            positions=pos, slot_mapping=(table[pos // block] * block + pos % block).astype(np.int32),
            token_seq=np.zeros(hi - lo, np.int32), block_tables=table[None, :],
            seq_lens=np.array([hi], np.int32), query_start_loc=np.array([0, hi - lo], np.int32))
        hidden, kv = fwd(params, kv, np.asarray(ids[lo:hi], np.int32), md)
        out.append(np.asarray(module.compute_logits(arch, params, hidden, kernels)))
    return np.concatenate(out)


HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf's permutation (rotate-half -> interleaved rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_path, out, drop=None, matrix_type=None):
    """Writes the HF checkpoint at ``hf_path`` as llama.cpp's converter would (q/k rows
    permuted for interleaved RoPE, the embedding in Q8_0) to the GGUF file ``out``, without
    tensor ``drop``; ``matrix_type``: a GGMLQuantizationType for every other matrix (default:
    float32).  Returns the HF checkpoint as ``load_model`` reads it."""
    import gguf

    from jaxllm.models.loader import load_model, read_safetensors
    loaded = load_model(hf_path)
    a = loaded.arch
    tensors = read_safetensors(os.path.join(hf_path, "model.safetensors"))
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(a.num_layers)
    w.add_context_length(a.max_position_embeddings)
    w.add_embedding_length(a.hidden_size)
    w.add_feed_forward_length(a.intermediate_size)
    w.add_head_count(a.num_heads)
    w.add_head_count_kv(a.num_kv_heads)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(a.rms_norm_eps)
    w.add_vocab_size(a.vocab_size)
    for name, t in tensors.items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        if name == "model.embed_tokens.weight":
            q = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor("token_embd.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        if name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            parts = name.split(".", 3)
            gname = f"blk.{parts[2]}.{HF_TO_GGUF[parts[3]]}"
            if parts[3].startswith("self_attn.q_proj"):
                t = llama_cpp_permute(t, a.num_heads)
            elif parts[3].startswith("self_attn.k_proj"):
                t = llama_cpp_permute(t, a.num_kv_heads)
        if gname == drop:
            continue
        if matrix_type is not None and t.ndim == 2:
            q = gguf.quants.quantize(t, matrix_type)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=matrix_type)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return loaded

"""A test-side HF -> GGUF converter for the families of ``jaxllm/models/gguf_arch.py``, written
from llama.cpp's ``convert_hf_to_gguf.py`` conventions (no llama.cpp install here):

* tensor names from the ``gguf`` package's own ``TensorNameMap`` (the table the converter uses),
  after each model class's ``modify_tensors`` renames (GPT-OSS's ``sinks`` -> ``sinks.weight``,
  ``down_proj`` -> ``down_proj.weight``, GLM-4-MoE's ``e_score_correction.bias``);
* the data changes: Q/K rows and biases permuted (``LlamaModel.permute``: SmolLM3, Granite),
  ``+ 1`` on every Gemma ``*norm.weight``, GPT-OSS's ``gate_up_proj`` transposed and split into
  its even (gate) and odd (up) columns and ``down_proj`` transposed, GLM-4-MoE's experts
  stacked, Phi-3's fused tensors kept whole and its LongRoPE factors written as tensors;
* the metadata ``set_gguf_parameters`` writes for each (``TextModel``'s generic keys, then the
  class's own), and nothing the converter does not write (Gemma's query_pre_attn_scalar,
  GPT-OSS's swiglu limit, SmolLM3's NoPE interval: llama.cpp fixes those per architecture),
  so :func:`write_gguf` refuses a checkpoint whose options a GGUF cannot carry.

``matrix_type``: a ``GGMLQuantizationType`` for every tensor of two or more dimensions whose
rows are whole blocks (the rest, norms and biases, stay F32, as llama.cpp's quantizer leaves them).
"""

from __future__ import annotations

import json
import os

import numpy as np

GGUF_ARCH = {"Gemma2ForCausalLM": "GEMMA2", "Gemma3ForCausalLM": "GEMMA3", "Phi3ForCausalLM": "PHI3",
             "SmolLM3ForCausalLM": "SMOLLM3", "Olmo2ForCausalLM": "OLMO2", "Olmo3ForCausalLM": "OLMO2",
             "GraniteForCausalLM": "GRANITE", "Glm4MoeForCausalLM": "GLM4_MOE", "GptOssForCausalLM": "GPT_OSS"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (rotate-half -> interleaved rows), weight or bias."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(cfg: dict) -> dict:
    """The global layers' rope parameters, whichever spelling transformers saved."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return rp.get("full_attention", rp)


def write_gguf(hf_path: str, out: str, matrix_type=None, drop: str | None = None, extra: dict | None = None,
               extra_tensors: dict | None = None) -> str:
    """Writes the HF folder ``hf_path`` as llama.cpp's converter would; ``drop``: a GGUF tensor
    name to leave out; ``extra``: further metadata keys (name -> int / float / str);
    ``extra_tensors``: further tensors (GGUF name -> float32 array)."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(hf_path, "config.json")) as f:
        cfg = json.load(f)
    hf_arch = cfg["architectures"][0]
    arch = getattr(gguf.MODEL_ARCH, GGUF_ARCH[hf_arch])
    tensors = {k: np.asarray(v, np.float32) for k, v in load_file(os.path.join(hf_path, "model.safetensors")).items()}
    L = cfg["num_hidden_layers"]
    nextn = cfg.get("num_nextn_predict_layers", 0) if hf_arch == "Glm4MoeForCausalLM" else 0
    heads, kv_heads, hidden = cfg["num_attention_heads"], cfg.get("num_key_value_heads"), cfg["hidden_size"]
    kv_heads = kv_heads or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = _rope(cfg)
    factors: dict[str, np.ndarray] = {}
    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])

    # --- metadata (TextModel.set_gguf_parameters, then the model class's own)
    w.add_block_count(L + nextn)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if hf_arch not in ("GraniteForCausalLM",) and cfg.get("head_dim"):   # Granite pops head_dim
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if hf_arch != "Gemma2ForCausalLM":   # Gemma2Model writes no rope keys (llama.cpp: base 10000)
        w.add_rope_freq_base(rope["rope_theta"])
    rope_type = rope.get("rope_type", "default")
    if rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(rope[key])
    if cfg.get("num_local_experts"):
        w.add_expert_count(cfg["num_local_experts"])
    if cfg.get("num_experts_per_tok"):
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("n_group") is not None:
        w.add_expert_group_count(cfg["n_group"])
    if cfg.get("topk_group") is not None:
        w.add_expert_group_used_count(cfg["topk_group"])

    if hf_arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        if cfg.get("query_pre_attn_scalar", head_dim) != head_dim:
            raise ValueError("llama.cpp's Gemma GGUF carries no query_pre_attn_scalar (it assumes head_dim)")
        if hf_arch == "Gemma2ForCausalLM":
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
            w.add_sliding_window(cfg["sliding_window"])
            want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
        else:
            if cfg.get("final_logit_softcapping"):
                w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
            w.add_sliding_window(cfg["sliding_window"])
            want = ["sliding_attention" if i % 6 != 5 else "full_attention" for i in range(L)]
            local = (cfg.get("rope_parameters") or {}).get("sliding_attention", {})
            if local.get("rope_theta", 10000.0) != 10000.0:
                raise ValueError("llama.cpp's Gemma 3 fixes the sliding layers' rope base at 10000")
        if cfg["layer_types"] != want:
            raise ValueError(f"llama.cpp's {hf_arch} layer pattern is {want}, the checkpoint has {cfg['layer_types']}")
    elif hf_arch == "Phi3ForCausalLM":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        rot = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        rope_dims = int(rot * hidden) // heads
        w.add_rope_dimension_count(rope_dims)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        if rope_type == "longrope":
            scale = cfg["max_position_embeddings"] / rope["original_max_position_embeddings"]
            orig = rope["original_max_position_embeddings"]
            w.add_rope_scaling_attn_factors(np.sqrt(1 + np.log(scale) / np.log(orig)) if scale > 1 else 1.0)
            factors = {"rope_factors_long.weight": np.asarray(rope["long_factor"], np.float32),
                       "rope_factors_short.weight": np.asarray(rope["short_factor"], np.float32)}
    elif hf_arch in ("SmolLM3ForCausalLM", "GraniteForCausalLM"):
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
        if hf_arch == "SmolLM3ForCausalLM":
            flags = cfg.get("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(L)]
            if flags != [int((i + 1) % 4 != 0) for i in range(L)]:
                raise ValueError("llama.cpp's SmolLM3 fixes NoPE on every 4th layer")
        else:
            w.add_attention_scale(cfg["attention_multiplier"])
            w.add_embedding_scale(cfg["embedding_multiplier"])
            w.add_residual_scale(cfg["residual_multiplier"])
            w.add_logit_scale(cfg["logits_scaling"])
    elif hf_arch in ("Olmo2ForCausalLM", "Olmo3ForCausalLM"):
        if cfg.get("sliding_window") is not None:
            w.add_sliding_window(cfg["sliding_window"])
            types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                               for i in range(L)]
            w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    elif hf_arch == "Glm4MoeForCausalLM":
        rp = cfg.get("rope_parameters") or {}
        w.add_rope_dimension_count(int(head_dim * rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))))
        w.add_expert_count(cfg["n_routed_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_nextn_predict_layers(nextn)
    elif hf_arch == "GptOssForCausalLM":
        if cfg.get("swiglu_limit", 7.0) != 7.0:
            raise ValueError("llama.cpp's gpt-oss fixes the SwiGLU limit at 7")
        w.add_sliding_window(cfg["sliding_window"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
    for key, value in (extra or {}).items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32 if isinstance(value, float) else w.add_string)(
            key, value)

    # --- tensors (modify_tensors, then the name map)
    tmap = gguf.get_tensor_name_map(arch, L + nextn)
    out_tensors: dict[str, np.ndarray] = dict(factors)   # Phi-3's LongRoPE factors first, as the converter writes them

    def put(hf_name: str, t: np.ndarray):
        name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        out_tensors[name] = t

    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, t in tensors.items():
        if hf_arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
            if name == "lm_head.weight":
                continue
            if name.endswith("norm.weight"):
                t = t + 1
        if hf_arch in ("SmolLM3ForCausalLM", "GraniteForCausalLM"):
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                t = _permute(t, heads)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                t = _permute(t, kv_heads)
        if hf_arch == "GptOssForCausalLM":
            if name.endswith("sinks"):
                name += ".weight"
            if name.endswith("down_proj_bias"):
                name = name.replace("down_proj_bias", "down_proj.bias")
            elif name.endswith("down_proj"):
                name, t = name + ".weight", np.swapaxes(t, -1, -2)
            elif name.endswith("gate_up_proj_bias"):
                put(name.replace("gate_up_proj_bias", "gate_proj.bias"), np.ascontiguousarray(t[..., ::2]))
                put(name.replace("gate_up_proj_bias", "up_proj.bias"), np.ascontiguousarray(t[..., 1::2]))
                continue
            elif name.endswith("gate_up_proj"):
                tt = np.swapaxes(t, -1, -2)
                put(name.replace("gate_up_proj", "gate_proj.weight"), np.ascontiguousarray(tt[:, ::2, :]))
                put(name.replace("gate_up_proj", "up_proj.weight"), np.ascontiguousarray(tt[:, 1::2, :]))
                continue
        if hf_arch == "Glm4MoeForCausalLM":
            if ".mlp.experts." in name:
                parts = name.split(".")
                experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = t
                continue
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        put(name, np.ascontiguousarray(t))
    for (layer, proj), got in sorted(experts.items()):
        put(f"model.layers.{layer}.mlp.experts.{proj}.weight", np.stack([got[e] for e in range(len(got))]))

    out_tensors.update(extra_tensors or {})
    for name, t in out_tensors.items():
        if name == drop:
            continue
        if matrix_type is not None and t.ndim >= 2 and t.shape[-1] % gguf.GGML_QUANT_SIZES[matrix_type][0] == 0:
            q = gguf.quants.quantize(t, matrix_type)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=matrix_type)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out

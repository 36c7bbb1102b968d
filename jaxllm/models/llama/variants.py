"""Config mapping of the Llama-family variants Phi-3, SmolLM3, OLMo 2/3, Granite and GLM-4-MoE.

Each is the decoder of ``models/llama/`` with some ``ArchConfig`` switches on; this module
reads those switches from the transformers config (``llama.config.LlamaConfig.from_hf``
calls :func:`family_b_fields` last, its values override the generic ones) and refuses, by
name, the options the engine does not implement instead of ignoring them:

* Phi-3 (``Phi3ForCausalLM``): fused ``qkv_proj`` / ``gate_up_proj`` (split at load, the
  parameter table's ``Chunk`` patterns), LongRoPE (``rope_scaling.type = longrope``),
  ``partial_rotary_factor`` (Phi-4-mini).
* SmolLM3: NoPE layers (``no_rope_layers``: 1 = RoPE, 0 = none; transformers derives it from
  ``no_rope_layer_interval``).
* OLMo 2/3: norms after attention and MLP only, q/k RMSNorm over the whole projection.
* Granite: embedding, residual, attention (the softmax scale) and logits multipliers.
* GLM-4-MoE: sigmoid routing with a score-correction bias, grouped top-k, shared experts,
  dense first layers, partial rotary, q/k/v bias, optional per-head q/k norm
  (:func:`glm4_moe_fields`).

OLMo 3's ``layer_types`` (sliding and full layers) become ``ArchConfig.layer_types``: each
layer's window is ``ArchConfig.window(i)``, and mixed layers run unrolled.  SmolLM3's sliding
NoPE layers are refused naming ``layer_types``.

Their GGUF metadata (llama.cpp's own architecture names: phi3, smollm3, olmo2, granite,
glm4moe) is read by :func:`from_gguf`: what ``convert_hf_to_gguf.py`` writes and how
``llama-model.cpp`` reads it back, into the same switches the safetensors twin gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from jaxllm.errors import ModelLoadError
from jaxllm.models.config import ArchConfig, MoeRouting, rope_scaling_from_dict
from jaxllm.models.gguf_arch import GgufMeta, base_fields, layer_types, refuse_scaling

FAMILY_B = ("Phi3ForCausalLM", "SmolLM3ForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM",
            "GraniteForCausalLM", "Glm4MoeForCausalLM")

FUSED_QKV = ("Phi3ForCausalLM",)
"""Checkpoints with one ``qkv_proj`` and one ``gate_up_proj`` per layer."""


def _rotary_dim(get, rope_params, head_dim: int) -> int:
    factor = None
    if isinstance(rope_params, dict):
        factor = rope_params.get("partial_rotary_factor")
    if factor is None:
        factor = get("partial_rotary_factor", default=1.0)
    dim = int(head_dim * float(factor))
    return 0 if dim == head_dim else dim


def _sliding_window(get, arch: str, where: str) -> tuple[int | None, tuple[str, ...]]:
    """(the sliding layers' window or None, the per-layer types when they mix sliding and full
    attention, else ())."""
    window = get("sliding_window")
    if arch == "SmolLM3ForCausalLM" and not get("use_sliding_window", default=False):
        window = None
    types = list(get("layer_types", default=None) or [])
    if window is None:
        return None, ()
    if not types or all(t == "sliding_attention" for t in types):
        return int(window), ()
    if all(t != "sliding_attention" for t in types):
        return None, ()
    if int(window) >= int(get("max_position_embeddings", default=4096)):
        return None, ()   # the window never cuts anything off within the model's context
    if arch != "Olmo3ForCausalLM":
        raise ModelLoadError(f"{where}: layer_types mixes sliding_attention and full_attention layers with "
                             f"sliding_window={window} (below max_position_embeddings); per-layer sliding windows "
                             f"are not supported for {arch}")
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if bad:
        raise ModelLoadError(f"{where}: layer_types {bad} are not supported (sliding_attention, full_attention)")
    return int(window), tuple(types)


def family_b_fields(arch: str, get, rope_params, where: str, head_dim: int) -> dict:
    """The ``ArchConfig`` fields of ``arch`` (one of :data:`FAMILY_B`) that differ from the
    generic Llama reading; ``get`` reads the transformers config."""
    bias = bool(get("attention_bias", default=False))
    out: dict = {"rotary_dim": _rotary_dim(get, rope_params, head_dim),
                 "qkv_bias": bias, "o_bias": bias}
    out["sliding_window"], out["layer_types"] = _sliding_window(get, arch, where)
    if arch == "SmolLM3ForCausalLM":
        flags = list(get("no_rope_layers", default=None) or [])
        if not flags:
            interval = int(get("no_rope_layer_interval", default=4))
            flags = [int((i + 1) % interval != 0) for i in range(int(get("num_hidden_layers")))]
        out["no_rope_layers"] = tuple(i for i, use_rope in enumerate(flags) if not use_rope)
    elif arch in ("Olmo2ForCausalLM", "Olmo3ForCausalLM"):
        out.update(post_norms_only=True, qk_norm=True, qk_norm_whole=True)
    elif arch == "GraniteForCausalLM":
        out.update(embedding_multiplier=float(get("embedding_multiplier", default=1.0)),
                   residual_multiplier=float(get("residual_multiplier", default=1.0)),
                   attention_multiplier=float(get("attention_multiplier", default=head_dim ** -0.5)),
                   logits_scaling=float(get("logits_scaling", default=1.0)))
    elif arch == "Glm4MoeForCausalLM":
        out.update(o_bias=False, qk_norm=bool(get("use_qk_norm", default=False)))
    return out


def glm4_moe_fields(get, num_experts: int, top_k: int, where: str) -> dict:
    """GLM-4-MoE's MoE fields (transformers' ``Glm4MoeTopkRouter`` / ``Glm4MoeMoE``)."""
    if num_experts <= 0:
        raise ModelLoadError(f"{where}: n_routed_experts must be positive for Glm4MoeForCausalLM")
    n_group = int(get("n_group", default=1))
    if n_group > 1 and num_experts // n_group < 2:
        raise ModelLoadError(f"{where}: n_group={n_group} leaves fewer than 2 experts per group "
                             "(a group's score is the sum of its best two)")
    topk_group = int(get("topk_group", default=1))
    if n_group > 1 and topk_group <= n_group and top_k > topk_group * (num_experts // n_group):
        raise ModelLoadError(f"{where}: num_experts_per_tok={top_k} exceeds the experts of topk_group={topk_group} "
                             f"of n_group={n_group} groups")
    return dict(num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(get("moe_intermediate_size", default=0)),
                norm_topk_prob=bool(get("norm_topk_prob", default=True)),
                moe=MoeRouting(first_k_dense=min(int(get("first_k_dense_replace", default=1)),
                                                 int(get("num_hidden_layers"))),
                               shared_experts=int(get("n_shared_experts", default=1)),
                               router_scoring="sigmoid", n_group=n_group, topk_group=int(get("topk_group", default=1)),
                               routed_scaling_factor=float(get("routed_scaling_factor", default=1.0))))


# ------------------------------------------------------------------ GGUF metadata

# GGUF general.architecture -> HF architecture.  OLMo 3 is written as olmo2 (with sliding
# window keys); it runs as Olmo3ForCausalLM when its layers mix sliding and full attention.
GGUF_ARCHITECTURES = {
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "glm4moe": "Glm4MoeForCausalLM",
}

# Phi-3's LongRoPE factors: read into the config, not parameters.
PHI3_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")

# Keys under "<arch>." each reader understands besides gguf_arch.COMMON_KEYS.
_GGUF_KEYS = {
    "phi3": {"attention.sliding_window", "rope.scaling.original_context_length", "rope.scaling.attn_factor"},
    "smollm3": set(),
    "olmo2": {"attention.sliding_window", "attention.sliding_window_pattern"},
    "granite": {"attention.scale", "embedding_scale", "residual_scale", "logit_scale"},
    "glm4moe": {"expert_count", "expert_used_count", "expert_feed_forward_length", "expert_shared_count",
                "leading_dense_block_count", "expert_gating_func", "expert_weights_scale", "expert_weights_norm",
                "expert_group_count", "expert_group_used_count", "nextn_predict_layers"},
}
# llama.cpp's OLMo 2 sliding pattern when the file has none (every 4th layer global).
_OLMO2_SWA_PERIOD = 4
# llama.cpp's SmolLM3: every 4th layer without RoPE (``n_no_rope_layer_step = 4``).
_SMOLLM3_NO_ROPE_STEP = 4


def gguf_fields(fields: dict, tensors: dict, gguf_arch: str, path: str) -> tuple[GgufMeta, dict]:
    """The ``ArchConfig`` fields of a GGUF file of one of :data:`GGUF_ARCHITECTURES`, the
    variant's switches among them (``tensors``: name -> shape as GGUF stores it, innermost
    first); ``LlamaConfig.from_gguf`` builds the config."""
    m = GgufMeta(fields, gguf_arch, path)
    m.refuse_unknown(_GGUF_KEYS[gguf_arch])
    base = base_fields(m, GGUF_ARCHITECTURES[gguf_arch], tensors)
    base.update(_READERS[gguf_arch](m, base, tensors))
    return m, base


def _phi3(m: GgufMeta, base: dict, tensors: dict) -> dict:
    head_dim = base["head_dim"]
    rotary = m.scalar("rope.dimension_count", default=head_dim)
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise ModelLoadError(f"{m.path}: phi3.rope.dimension_count {rotary} must be even and at most {head_dim}")
    out: dict = {"rotary_dim": 0 if rotary == head_dim else rotary}
    window = m.scalar("attention.sliding_window", default=0)
    out["sliding_window"] = window or None   # the converter writes 0 for "none"
    have = [n for n in PHI3_FACTORS if n in tensors]
    if have:
        if len(have) != 2:
            missing = next(n for n in PHI3_FACTORS if n not in tensors)
            raise ModelLoadError(f"{m.path}: missing tensor {missing!r} (LongRoPE needs both factor tensors)")
        original = m.scalar("rope.scaling.original_context_length", required=True)
        d = {"rope_type": "longrope", "original_max_position_embeddings": original,
             "_max_position_embeddings": base["max_position_embeddings"],
             # the factor tensors are filled in by load(); their length is checked there
             "short_factor": [], "long_factor": []}
        attn = m.scalar("rope.scaling.attn_factor", float)
        if attn is not None:
            d["attention_factor"] = attn
        out["rope_scaling"] = rope_scaling_from_dict(d, m.path)
    return out


def _smollm3(m: GgufMeta, base: dict, tensors: dict) -> dict:
    L = base["num_layers"]
    return {"no_rope_layers": tuple(i for i in range(L) if (i + 1) % _SMOLLM3_NO_ROPE_STEP == 0)}


def _olmo2(m: GgufMeta, base: dict, tensors: dict) -> dict:
    L = base["num_layers"]
    window = m.scalar("attention.sliding_window")
    types = layer_types(m, L, window, _OLMO2_SWA_PERIOD)
    out: dict = {"post_norms_only": True, "qk_norm": True, "qk_norm_whole": True,
                 "sliding_window": window or None, "layer_types": ()}
    if types and all(t == "sliding_attention" for t in types):
        pass   # every layer slides: one window for all
    elif types:
        out["layer_types"] = types
        out["architecture"] = "Olmo3ForCausalLM"
    else:
        out["sliding_window"] = None
    refuse_scaling(m)
    return out


def _granite(m: GgufMeta, base: dict, tensors: dict) -> dict:
    return {"embedding_multiplier": m.scalar("embedding_scale", float, default=1.0),
            "residual_multiplier": m.scalar("residual_scale", float, default=1.0),
            "attention_multiplier": m.scalar("attention.scale", float, default=base["head_dim"] ** -0.5),
            "logits_scaling": m.scalar("logit_scale", float, default=1.0)}


def _glm4_moe(m: GgufMeta, base: dict, tensors: dict) -> dict:
    head_dim = base["head_dim"]
    rotary = m.scalar("rope.dimension_count", default=head_dim // 2)
    nextn = m.scalar("nextn_predict_layers", default=0)
    L = base["num_layers"] - nextn   # the converter counts the MTP block(s) in block_count
    if L <= 0:
        raise ModelLoadError(f"{m.path}: glm4moe.block_count leaves no decoder layer after {nextn} nextn layers")
    gating = m.scalar("expert_gating_func", default=2)
    if gating != 2:   # llama_expert_gating_func_type: 1 softmax, 2 sigmoid
        raise ModelLoadError(f"{m.path}: glm4moe.expert_gating_func {gating} is not supported (only 2, sigmoid)")
    experts = m.scalar("expert_count", required=True)
    n_group = m.scalar("expert_group_count", default=1)
    values = {"n_group": n_group, "topk_group": m.scalar("expert_group_used_count", default=1),
              "moe_intermediate_size": m.scalar("expert_feed_forward_length", required=True),
              "norm_topk_prob": bool(m.get("expert_weights_norm", False)),
              "first_k_dense_replace": m.scalar("leading_dense_block_count", default=0),
              "n_shared_experts": m.scalar("expert_shared_count", default=0),
              "routed_scaling_factor": m.scalar("expert_weights_scale", float, default=1.0),
              "num_hidden_layers": L}
    moe = glm4_moe_fields(lambda name, default=None: values.get(name, default), experts,
                          m.scalar("expert_used_count", required=True), m.path)
    refuse_scaling(m)
    return {**moe, "num_layers": L, "rotary_dim": 0 if rotary == head_dim else rotary, "o_bias": False,
            "qk_norm": "blk.0.attn_q_norm.weight" in tensors}


def with_longrope_factors(arch: ArchConfig, read: Callable[[str], np.ndarray], path: str) -> ArchConfig:
    """Phi-3's ``rope_factors_short`` / ``rope_factors_long`` tensors (``read``: a tensor's values
    by name) into its ``RopeScaling``."""
    n = arch.rope_dim // 2
    factors = {}
    for key, tname in (("long_factor", "rope_factors_long.weight"), ("short_factor", "rope_factors_short.weight")):
        v = np.asarray(read(tname), np.float64).reshape(-1)
        if v.size != n:
            raise ModelLoadError(f"{path}: tensor {tname!r} has {v.size} factors, expected {n} "
                                 f"(rope dims {arch.rope_dim} / 2)")
        factors[key] = tuple(float(x) for x in v)
    return replace(arch, rope_scaling=replace(arch.rope_scaling, **factors))


_READERS: dict[str, Callable] = {"phi3": _phi3, "smollm3": _smollm3, "olmo2": _olmo2, "granite": _granite,
                                 "glm4moe": _glm4_moe}

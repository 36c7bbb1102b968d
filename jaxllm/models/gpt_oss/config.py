"""GPT-OSS's config reader: a transformers ``GptOssConfig`` -> ``ArchConfig`` (sinks, YaRN, the
clamped SwiGLU's constants, the per-layer attention kinds)."""

from __future__ import annotations

from jaxllm.errors import ModelLoadError
from jaxllm.models.config import ArchConfig, _eos_tuple, rope_scaling_from_dict

ROPE_TYPES = ("default", "yarn")



def arch_config(hf, arch: str, where: str) -> ArchConfig:
    """A ``GptOssConfig`` -> ArchConfig; refuses by name what the model does not implement."""
    def get(name, default=None):
        v = getattr(hf, name, None)
        return default if v is None else v

    act = get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported for {arch} (the clamped SwiGLU only)")
    L = int(get("num_hidden_layers"))
    layer_types = tuple(get("layer_types") or ())
    if len(layer_types) != L or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"{where}: layer_types must name sliding_attention or full_attention for each of "
                             f"the {L} layers, got {list(layer_types)}")
    window = get("sliding_window")
    if "sliding_attention" in layer_types and not window:
        raise ModelLoadError(f"{where}: sliding layers need a positive sliding_window, got {window!r}")
    rope = dict(get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", get("rope_theta", 150000.0)))
    scaling = rope_scaling_from_dict(rope, where, ROPE_TYPES)
    heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    num_experts = int(get("num_local_experts", 0))
    top_k = int(get("num_experts_per_tok", 0))
    if num_experts <= 0:
        raise ModelLoadError(f"{where}: num_local_experts must be positive for {arch}, got {num_experts}")
    bias = bool(get("attention_bias", True))
    inter = int(get("intermediate_size"))
    return ArchConfig(
        architecture=arch,
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=L,
        num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads", heads)),
        head_dim=int(get("head_dim") or hidden // heads),
        rms_norm_eps=float(get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        sliding_window=int(window) if window else None,
        bos_token_id=get("bos_token_id"),
        eos_token_ids=_eos_tuple(get("eos_token_id")),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        norm_topk_prob=True,
        layer_types=layer_types,
        swiglu_alpha=float(get("swiglu_alpha", 1.702)),
        swiglu_limit=float(get("swiglu_limit", 7.0)),
    )

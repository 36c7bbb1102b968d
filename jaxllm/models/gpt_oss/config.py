"""GPT-OSS's config (:class:`GptOssConfig`): a transformers ``GptOssConfig`` or llama.cpp's gpt-oss
GGUF metadata -> ``ArchConfig`` (sinks, YaRN, the clamped SwiGLU's constants, the per-layer
attention kinds)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.errors import ModelLoadError
from jaxllm.models.config import ArchConfig, FamilyConfig, _eos_tuple, rope_scaling_from_dict
from jaxllm.models.gguf_arch import GgufMeta, base_fields, finish, layer_types

ROPE_TYPES = ("default", "yarn")
GGUF_ARCHITECTURES = {"gpt-oss": "GptOssForCausalLM"}

# Keys under "gpt-oss." the GGUF reader understands besides gguf_arch.COMMON_KEYS.
_GGUF_KEYS = {"expert_count", "expert_used_count", "expert_feed_forward_length", "attention.sliding_window",
              "attention.sliding_window_pattern", "rope.scaling.type", "rope.scaling.factor",
              "rope.scaling.original_context_length", "rope.scaling.yarn_beta_fast",
              "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_ext_factor"}
# llama.cpp's fixed sliding pattern (``set_swa_pattern(2)``) when the file has none.
_SWA_PERIOD = 2


@dataclass(frozen=True)
class GptOssConfig(FamilyConfig):
    """GPT-OSS's own knobs (``ArchConfig.gpt_oss``) and its readers (the registry's ``Family.config``)."""

    swiglu_alpha: float = 1.702
    """The experts' clamped SwiGLU: ``(clip(up, -l, l) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, l)``."""
    swiglu_limit: float = 7.0

    @classmethod
    def from_hf(cls, hf, arch: str, where: str) -> ArchConfig:
        return _from_hf(hf, arch, where)

    @classmethod
    def from_gguf(cls, fields: dict, tensors: dict, gguf_arch: str, path: str, read=None) -> ArchConfig:
        """llama.cpp's gpt-oss metadata (``tensors``: name -> GGUF shape)."""
        m = GgufMeta(fields, gguf_arch, path)
        m.refuse_unknown(_GGUF_KEYS)
        base = base_fields(m, GGUF_ARCHITECTURES[gguf_arch], tensors)
        base.update(_gguf(m, base, tensors))
        return finish(m, base)



def _from_hf(hf, arch: str, where: str) -> ArchConfig:
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
        gpt_oss=GptOssConfig(swiglu_alpha=float(get("swiglu_alpha", 1.702)),
                             swiglu_limit=float(get("swiglu_limit", 7.0))),
    )


def _gguf(m: GgufMeta, base: dict, tensors: dict) -> dict:
    L = base["num_layers"]
    window = m.scalar("attention.sliding_window", required=True)
    out: dict = {"sliding_window": window or None,
                 "layer_types": layer_types(m, L, window, _SWA_PERIOD) or ("full_attention",) * L,
                 "num_experts": m.scalar("expert_count", required=True),
                 "num_experts_per_tok": m.scalar("expert_used_count", required=True),
                 "moe_intermediate_size": m.scalar("expert_feed_forward_length", required=True),
                 "norm_topk_prob": True,
                 # llama.cpp's gpt-oss experts: the clamped SwiGLU with alpha 1.702 and limit 7 (fixed)
                 "gpt_oss": GptOssConfig(swiglu_alpha=1.702, swiglu_limit=7.0),
                 "rope_theta": m.scalar("rope.freq_base", float, default=150000.0),
                 "rms_norm_eps": m.scalar("attention.layer_norm_rms_epsilon", float, default=1e-5)}
    out["intermediate_size"] = base["intermediate_size"] or out["moe_intermediate_size"]
    t = m.get("rope.scaling.type")
    if t == "yarn":
        ext = m.scalar("rope.scaling.yarn_ext_factor", float)
        if ext not in (None, 1.0):
            raise ModelLoadError(f"{m.path}: gpt-oss.rope.scaling.yarn_ext_factor {ext} is not supported (only 1)")
        d = {"rope_type": "yarn", "factor": m.scalar("rope.scaling.factor", float, required=True),
             "original_max_position_embeddings": m.scalar("rope.scaling.original_context_length", required=True),
             # GPT-OSS's YaRN ramp is not rounded to whole dims (its config's truncate=false)
             "truncate": False}
        for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow"),
                          ("rope.scaling.yarn_attn_factor", "attention_factor")):
            v = m.scalar(key, float)
            if v is not None:
                d[name] = v
        out["rope_scaling"] = rope_scaling_from_dict(d, m.path, ROPE_TYPES)
    elif t not in (None, "none"):
        raise ModelLoadError(f"{m.path}: gpt-oss.rope.scaling.type {t!r} is not supported (none, yarn)")
    return out

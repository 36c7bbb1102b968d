"""Gemma 2/3's config reader (a transformers config -> ``ArchConfig``) and its further RoPE
tables (Gemma 3's sliding layers' base)."""

from __future__ import annotations

from jaxllm.errors import ModelLoadError
from jaxllm.models.config import ArchConfig, RopeScaling, _eos_tuple, rope_scaling_from_dict

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")



def arch_config(hf, arch: str, where: str) -> ArchConfig:
    """A Gemma 2 or Gemma 3 text config (``Gemma2Config``, ``Gemma3TextConfig``; a
    ``Gemma3Config`` is read through its text config) -> ArchConfig; refuses by name what the
    model does not implement."""
    if hasattr(hf, "text_config") and getattr(hf, "text_config", None) is not None:
        hf = hf.get_text_config()

    def get(name, default=None):
        v = getattr(hf, name, None)
        return default if v is None else v

    act = get("hidden_activation") or get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"{where}: hidden_activation {act!r} is not supported for {arch} "
                             "(only gelu_pytorch_tanh)")
    if get("use_bidirectional_attention", False):
        raise ModelLoadError(f"{where}: use_bidirectional_attention=true is not supported (a causal decoder only)")
    L = int(get("num_hidden_layers"))
    layer_types = tuple(get("layer_types") or ())
    if len(layer_types) != L or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"{where}: layer_types must name sliding_attention or full_attention for each of "
                             f"the {L} layers, got {list(layer_types)}")
    window = get("sliding_window")
    if "sliding_attention" in layer_types and not window:
        raise ModelLoadError(f"{where}: sliding layers need a positive sliding_window, got {window!r}")
    rope = get("rope_parameters") or {}
    local_theta = None
    if arch == "Gemma3ForCausalLM":
        full = rope.get("full_attention") or {}
        local = rope.get("sliding_attention") or {}
        if (local.get("rope_type") or "default") != "default":
            raise ModelLoadError(f"{where}: the sliding layers' rope_type {local.get('rope_type')!r} is not "
                                 "supported (only default)")
        theta = float(full.get("rope_theta", 1_000_000.0))
        local_theta = float(local.get("rope_theta", 10_000.0))
        scaling = rope_scaling_from_dict(full, where)
    else:
        if "full_attention" in rope:   # a per-layer-type dict (not written by Gemma2Config)
            raise ModelLoadError(f"{where}: per-layer-type rope_parameters are not supported for {arch}")
        theta = float(rope.get("rope_theta", get("rope_theta", 10_000.0)))
        scaling = rope_scaling_from_dict(rope, where)
    heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    bias = bool(get("attention_bias", False))
    return ArchConfig(
        architecture=arch,
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_layers=L,
        num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads", heads)),
        head_dim=int(get("head_dim") or hidden // heads),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(get("tie_word_embeddings", True)),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=arch == "Gemma3ForCausalLM",
        sliding_window=int(window) if window else None,
        bos_token_id=get("bos_token_id"),
        eos_token_ids=_eos_tuple(get("eos_token_id")),
        layer_types=layer_types,
        attn_scale=float(get("query_pre_attn_scalar")) ** -0.5 if get("query_pre_attn_scalar") else None,
        attn_soft_cap=float(get("attn_logit_softcapping")) if get("attn_logit_softcapping") else None,
        final_soft_cap=float(get("final_logit_softcapping")) if get("final_logit_softcapping") else None,
        rope_local_theta=local_theta,
    )


def rope_tables(arch: ArchConfig) -> dict[str, tuple[float, RopeScaling]]:
    """The extra RoPE frequency tables the loader computes: name -> (theta, scaling)."""
    if arch.rope_local_theta is None:
        return {}
    return {"rope_local_inv_freq": (arch.rope_local_theta, RopeScaling())}

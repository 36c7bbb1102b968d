"""Gemma 2/3's config (:class:`GemmaConfig`: a transformers config or llama.cpp's gemma2 / gemma3
GGUF metadata -> ``ArchConfig``) and its further RoPE tables (Gemma 3's sliding layers' base)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.errors import ModelLoadError
from jaxllm.models.config import ArchConfig, FamilyConfig, RopeScaling, _eos_tuple, rope_scaling_from_dict
from jaxllm.models.gguf_arch import GgufMeta, base_fields, finish, layer_types, refuse_scaling

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
_GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
GGUF_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

# Keys under "<arch>." the GGUF reader understands besides gguf_arch.COMMON_KEYS.
_GGUF_KEYS = {
    "gemma2": {"attn_logit_softcapping", "final_logit_softcapping", "attention.sliding_window",
               "attention.sliding_window_pattern", "attention.scale"},
    "gemma3": {"final_logit_softcapping", "attention.sliding_window", "attention.sliding_window_pattern",
               "attention.scale", "rope.freq_base_swa", "rope.scaling.type", "rope.scaling.factor"},
}
# llama.cpp's fixed sliding patterns (``set_swa_pattern(n)``) when the file has none.
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}
# Layer counts llama.cpp's Gemma reader treats as the 27B models, whose softmax scale is
# (hidden / heads) ** -0.5 (query_pre_attn_scalar = 144) rather than head_dim ** -0.5.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


@dataclass(frozen=True)
class GemmaConfig(FamilyConfig):
    """Gemma 2/3's own knobs (``ArchConfig.gemma``) and its readers (the registry's ``Family.config``)."""

    attn_soft_cap: float | None = None
    """Attention scores become ``c * tanh(s / c)`` (Gemma 2's ``attn_logit_softcapping``)."""
    final_soft_cap: float | None = None
    """Logits become ``c * tanh(z / c)`` (Gemma's ``final_logit_softcapping``)."""
    rope_local_theta: float | None = None
    """Gemma 3: the sliding layers' RoPE base (default rope); the full layers take
    ``rope_theta`` with ``rope_scaling``."""

    @classmethod
    def from_hf(cls, hf, arch: str, where: str) -> ArchConfig:
        return _from_hf(hf, arch, where)

    @classmethod
    def from_gguf(cls, fields: dict, tensors: dict, gguf_arch: str, path: str, read=None) -> ArchConfig:
        """llama.cpp's gemma2 / gemma3 metadata (``tensors``: name -> GGUF shape)."""
        m = GgufMeta(fields, gguf_arch, path)
        m.refuse_unknown(_GGUF_KEYS[gguf_arch])
        base = base_fields(m, GGUF_ARCHITECTURES[gguf_arch], tensors)
        base.update(_gguf(m, base, tensors))
        return finish(m, base)



def _from_hf(hf, arch: str, where: str) -> ArchConfig:
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
    if arch in _GEMMA3:
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
        qk_norm=arch in _GEMMA3,
        sliding_window=int(window) if window else None,
        bos_token_id=get("bos_token_id"),
        eos_token_ids=_eos_tuple(get("eos_token_id")),
        layer_types=layer_types,
        attn_scale=float(get("query_pre_attn_scalar")) ** -0.5 if get("query_pre_attn_scalar") else None,
        gemma=GemmaConfig(
            attn_soft_cap=float(get("attn_logit_softcapping")) if get("attn_logit_softcapping") else None,
            final_soft_cap=float(get("final_logit_softcapping")) if get("final_logit_softcapping") else None,
            rope_local_theta=local_theta),
    )


def rope_tables(arch: ArchConfig) -> dict[str, tuple[float, RopeScaling]]:
    """The extra RoPE frequency tables the loader computes: name -> (theta, scaling)."""
    if arch.gemma is None or arch.gemma.rope_local_theta is None:
        return {}
    return {"rope_local_inv_freq": (arch.gemma.rope_local_theta, RopeScaling())}


def _gguf(m: GgufMeta, base: dict, tensors: dict) -> dict:
    L, hidden, heads, head_dim = base["num_layers"], base["hidden_size"], base["num_heads"], base["head_dim"]
    window = m.scalar("attention.sliding_window", default=4096 if m.arch == "gemma2" else None)
    out: dict = {"sliding_window": window or None,
                 "layer_types": layer_types(m, L, window, _SWA_PERIOD[m.arch]) or ("full_attention",) * L}
    # The softmax scale: llama.cpp derives it from the model size (query_pre_attn_scalar is
    # not written); attention.scale, where a file has it, is the scale itself.
    scale = m.scalar("attention.scale", float)
    if scale is None:
        scale = (hidden // heads) ** -0.5 if L == _GEMMA_27B_LAYERS[m.arch] else head_dim ** -0.5
    out["attn_scale"] = scale
    caps = {"final_soft_cap": m.scalar("final_logit_softcapping", float) or None}
    if m.arch == "gemma2":
        # llama.cpp reads both caps as optional, defaulting to Gemma 2's 50 and 30 (llama-hparams.h)
        caps["attn_soft_cap"] = m.scalar("attn_logit_softcapping", float, default=50.0) or None
        caps["final_soft_cap"] = m.scalar("final_logit_softcapping", float, default=30.0) or None
        refuse_scaling(m)
    else:
        out["qk_norm"] = True
        # llama.cpp: the sliding layers' base is 10000 (rope.freq_base_swa where written),
        # unscaled; the global layers take rope.freq_base with the file's scaling.
        caps["rope_local_theta"] = m.scalar("rope.freq_base_swa", float, default=10000.0)
        out["rope_theta"] = m.scalar("rope.freq_base", float, default=1_000_000.0)
        t = m.get("rope.scaling.type")
        if t == "linear":
            out["rope_scaling"] = rope_scaling_from_dict(
                {"rope_type": "linear", "factor": m.scalar("rope.scaling.factor", float, required=True)}, m.path)
        elif t not in (None, "none"):
            raise ModelLoadError(f"{m.path}: gemma3.rope.scaling.type {t!r} is not supported (none, linear)")
    out["max_position_embeddings"] = m.scalar("context_length", default=8192)
    out["gemma"] = GemmaConfig(**caps)
    return out

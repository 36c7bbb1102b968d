"""GGUF metadata of the families llama.cpp writes with their own architecture names: Gemma 2/3,
Phi-3, SmolLM3, OLMo 2/3, Granite, GLM-4-MoE and GPT-OSS.

``models/loader.load_gguf`` reads a file whose ``general.architecture`` is one of
:data:`ARCHITECTURES` into its ``ArchConfig`` with :func:`arch_config`: the metadata llama.cpp's
``convert_hf_to_gguf.py`` writes and how ``llama-model.cpp`` reads it back, turned into the
same ``ArchConfig`` the safetensors twin gives: soft caps, sliding windows and their per-layer
pattern (``attention.sliding_window_pattern``, else llama.cpp's fixed pattern of the
architecture), rope bases and scaling, attention scales, multipliers, expert routing.  A key
under ``<arch>.`` that is not understood is refused by name: it could change the function.

The tensors are not read here: each family's parameter table names them and says what the
converter did to them (``params.Stored``, ``params.Chunk``, ``Param.rope_heads``), and the one
loader (``models/loader.py``) undoes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from jaxllm.errors import ModelLoadError
from jaxllm.models.config import ArchConfig, RopeScaling, rope_scaling_from_dict
from jaxllm.models.llama.variants import glm4_moe_fields
from jaxllm.models.gpt_oss import ROPE_TYPES

# GGUF general.architecture -> HF architecture.  OLMo 3 is written as olmo2 (with sliding
# window keys); it runs as Olmo3ForCausalLM when its layers mix sliding and full attention.
ARCHITECTURES = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "glm4moe": "Glm4MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}

# Phi-3's LongRoPE factors: read into the config, not parameters.
PHI3_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


# ------------------------------------------------------------------ metadata

# Keys under "<arch>." every architecture may carry without changing the function (checked
# against what they must agree with, or informational).
_COMMON_KEYS = {"context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
                "attention.head_count", "attention.head_count_kv", "attention.key_length",
                "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.dimension_count",
                "rope.freq_base", "rope.scaling.finetuned"}

# Further keys each architecture's reader understands.
_ARCH_KEYS = {
    "gemma2": {"attn_logit_softcapping", "final_logit_softcapping", "attention.sliding_window",
               "attention.sliding_window_pattern", "attention.scale"},
    "gemma3": {"final_logit_softcapping", "attention.sliding_window", "attention.sliding_window_pattern",
               "attention.scale", "rope.freq_base_swa", "rope.scaling.type", "rope.scaling.factor"},
    "phi3": {"attention.sliding_window", "rope.scaling.original_context_length", "rope.scaling.attn_factor"},
    "smollm3": set(),
    "olmo2": {"attention.sliding_window", "attention.sliding_window_pattern"},
    "granite": {"attention.scale", "embedding_scale", "residual_scale", "logit_scale"},
    "glm4moe": {"expert_count", "expert_used_count", "expert_feed_forward_length", "expert_shared_count",
                "leading_dense_block_count", "expert_gating_func", "expert_weights_scale", "expert_weights_norm",
                "expert_group_count", "expert_group_used_count", "nextn_predict_layers"},
    "gpt-oss": {"expert_count", "expert_used_count", "expert_feed_forward_length", "attention.sliding_window",
                "attention.sliding_window_pattern", "rope.scaling.type", "rope.scaling.factor",
                "rope.scaling.original_context_length", "rope.scaling.yarn_beta_fast",
                "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_ext_factor"},
}

# llama.cpp's fixed per-architecture patterns (llama-model.cpp ``set_swa_pattern(n)``: layer i
# slides unless i % n == n - 1), used when the file has no sliding_window_pattern.
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2, "olmo2": 4}
# llama.cpp's SmolLM3: every 4th layer without RoPE (``n_no_rope_layer_step = 4``).
_SMOLLM3_NO_ROPE_STEP = 4
# Layer counts llama.cpp's Gemma reader treats as the 27B models, whose softmax scale is
# (hidden / heads) ** -0.5 (query_pre_attn_scalar = 144) rather than head_dim ** -0.5.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


class _Meta:
    """The file's metadata under ``<arch>.``: typed reads, and the refusal of keys no reader
    here understands."""

    def __init__(self, fields: dict, arch: str, path: str):
        self.fields, self.arch, self.path = fields, arch, path

    def get(self, key: str, default=None, required: bool = False):
        full = f"{self.arch}.{key}"
        v = self.fields.get(full)
        if v is None:
            if required:
                raise ModelLoadError(f"{self.path}: GGUF metadata key {full!r} is missing")
            return default
        return v

    def scalar(self, key: str, cast=int, default=None, required: bool = False):
        v = self.get(key, default, required)
        if v is None:
            return None
        if isinstance(v, list):
            if len(set(v)) != 1:
                raise ModelLoadError(f"{self.path}: GGUF metadata key {self.arch}.{key} differs between layers "
                                     f"({v}); per-layer values are not supported")
            v = v[0]
        return cast(v)

    def refuse_unknown(self):
        known = _COMMON_KEYS | _ARCH_KEYS[self.arch]
        prefix = self.arch + "."
        unknown = sorted(k for k in self.fields if k.startswith(prefix) and k[len(prefix):] not in known)
        if unknown:
            raise ModelLoadError(f"{self.path}: GGUF metadata key {unknown[0]!r} is not supported for "
                                 f"{self.arch} (it may change the model's function; understood: "
                                 f"{', '.join(sorted(known))})")


def _layer_types(m: _Meta, L: int, window: int | None, default_period: int | None) -> tuple[str, ...]:
    """Per-layer attention kinds: the file's sliding_window_pattern (true: sliding), else
    llama.cpp's fixed period for the architecture; () when no layer slides."""
    if not window:
        return ()
    pattern = m.get("attention.sliding_window_pattern")
    if pattern is not None:
        if not isinstance(pattern, list) or len(pattern) != L:
            raise ModelLoadError(f"{m.path}: {m.arch}.attention.sliding_window_pattern must hold one boolean per "
                                 f"layer ({L}), got {pattern!r}")
        sliding = [bool(p) for p in pattern]
    elif default_period is None:
        sliding = [True] * L
    else:
        sliding = [i % default_period != default_period - 1 for i in range(L)]
    if not any(sliding):
        return ()
    return tuple("sliding_attention" if s else "full_attention" for s in sliding)


def _check_rope_dims(m: _Meta, rotary: int, head_dim: int):
    n_rot = m.scalar("rope.dimension_count")
    if n_rot is not None and n_rot != rotary:
        raise ModelLoadError(f"{m.path}: {m.arch}.rope.dimension_count is {n_rot}, but this architecture rotates "
                             f"{rotary} of {head_dim} dims per head")


def _refuse_scaling(m: _Meta):
    t = m.get("rope.scaling.type")
    if t not in (None, "none"):
        raise ModelLoadError(f"{m.path}: {m.arch}.rope.scaling.type {t!r} is not supported for {m.arch}")


def arch_config(fields: dict, tensors: dict, gguf_arch: str, path: str) -> ArchConfig:
    """The ``ArchConfig`` of a GGUF file of one of :data:`ARCHITECTURES` (``tensors``: name ->
    shape as GGUF stores it, innermost first)."""
    m = _Meta(fields, gguf_arch, path)
    m.refuse_unknown()
    heads = m.scalar("attention.head_count", required=True)
    kv_heads = m.scalar("attention.head_count_kv", default=heads)
    hidden = m.scalar("embedding_length", required=True)
    head_dim = m.scalar("attention.key_length", default=hidden // heads)
    value_dim = m.scalar("attention.value_length", default=head_dim)
    if value_dim != head_dim:
        raise ModelLoadError(f"{path}: {gguf_arch}.attention.value_length ({value_dim}) differs from key_length "
                             f"({head_dim}); only equal key and value head sizes are supported")
    L = m.scalar("block_count", required=True)
    embd = tensors.get("token_embd.weight")
    vocab = m.scalar("vocab_size", default=None)
    if vocab is None:
        if embd is None:
            raise ModelLoadError(f"{path}: missing tensor 'token_embd.weight'")
        vocab = int(embd[-1])
    # The ids that end a generation: llama.cpp's end-of-generation set (eos, eot, eom), which
    # for chat models (Phi-3's <|end|>, GLM's <|user|>) is more than eos alone.
    eog = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = fields.get(f"tokenizer.ggml.{key}")
        if v is not None and int(v) not in eog:
            eog.append(int(v))
    base = {
        "architecture": ARCHITECTURES[gguf_arch], "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": m.scalar("feed_forward_length", default=0) or 0, "num_layers": L,
        "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": m.scalar("attention.layer_norm_rms_epsilon", float, default=1e-6),
        "rope_theta": m.scalar("rope.freq_base", float, default=10000.0), "rope_scaling": RopeScaling(),
        "max_position_embeddings": m.scalar("context_length", default=4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "qkv_bias": "blk.0.attn_q.bias" in tensors, "o_bias": "blk.0.attn_output.bias" in tensors,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_ids": tuple(eog),
    }
    extra = _READERS[gguf_arch](m, base, tensors)
    base.update(extra)
    rotary = base.get("rotary_dim") or head_dim
    if gguf_arch != "phi3":   # Phi-3's rope.dimension_count is checked against partial rotary there
        _check_rope_dims(m, rotary, head_dim)
    return ArchConfig(**base)


def _gemma(m: _Meta, base: dict, tensors: dict) -> dict:
    L, hidden, heads, head_dim = base["num_layers"], base["hidden_size"], base["num_heads"], base["head_dim"]
    window = m.scalar("attention.sliding_window", default=4096 if m.arch == "gemma2" else None)
    out: dict = {"sliding_window": window or None,
                 "layer_types": _layer_types(m, L, window, _SWA_PERIOD[m.arch]) or ("full_attention",) * L}
    # The softmax scale: llama.cpp derives it from the model size (query_pre_attn_scalar is
    # not written); attention.scale, where a file has it, is the scale itself.
    scale = m.scalar("attention.scale", float)
    if scale is None:
        scale = (hidden // heads) ** -0.5 if L == _GEMMA_27B_LAYERS[m.arch] else head_dim ** -0.5
    out["attn_scale"] = scale
    out["final_soft_cap"] = m.scalar("final_logit_softcapping", float) or None
    if m.arch == "gemma2":
        # llama.cpp reads both caps as optional, defaulting to Gemma 2's 50 and 30 (llama-hparams.h)
        out["attn_soft_cap"] = m.scalar("attn_logit_softcapping", float, default=50.0) or None
        out["final_soft_cap"] = m.scalar("final_logit_softcapping", float, default=30.0) or None
        _refuse_scaling(m)
    else:
        out["qk_norm"] = True
        # llama.cpp: the sliding layers' base is 10000 (rope.freq_base_swa where written),
        # unscaled; the global layers take rope.freq_base with the file's scaling.
        out["rope_local_theta"] = m.scalar("rope.freq_base_swa", float, default=10000.0)
        out["rope_theta"] = m.scalar("rope.freq_base", float, default=1_000_000.0)
        t = m.get("rope.scaling.type")
        if t == "linear":
            out["rope_scaling"] = rope_scaling_from_dict(
                {"rope_type": "linear", "factor": m.scalar("rope.scaling.factor", float, required=True)}, m.path)
        elif t not in (None, "none"):
            raise ModelLoadError(f"{m.path}: gemma3.rope.scaling.type {t!r} is not supported (none, linear)")
    out["max_position_embeddings"] = m.scalar("context_length", default=8192)
    return out


def _phi3(m: _Meta, base: dict, tensors: dict) -> dict:
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


def _smollm3(m: _Meta, base: dict, tensors: dict) -> dict:
    L = base["num_layers"]
    return {"no_rope_layers": tuple(i for i in range(L) if (i + 1) % _SMOLLM3_NO_ROPE_STEP == 0)}


def _olmo2(m: _Meta, base: dict, tensors: dict) -> dict:
    L = base["num_layers"]
    window = m.scalar("attention.sliding_window")
    types = _layer_types(m, L, window, _SWA_PERIOD["olmo2"])
    out: dict = {"post_norms_only": True, "qk_norm": True, "qk_norm_whole": True,
                 "sliding_window": window or None, "layer_types": ()}
    if types and all(t == "sliding_attention" for t in types):
        pass   # every layer slides: one window for all
    elif types:
        out["layer_types"] = types
        out["architecture"] = "Olmo3ForCausalLM"
    else:
        out["sliding_window"] = None
    _refuse_scaling(m)
    return out


def _granite(m: _Meta, base: dict, tensors: dict) -> dict:
    return {"embedding_multiplier": m.scalar("embedding_scale", float, default=1.0),
            "residual_multiplier": m.scalar("residual_scale", float, default=1.0),
            "attention_multiplier": m.scalar("attention.scale", float, default=base["head_dim"] ** -0.5),
            "logits_scaling": m.scalar("logit_scale", float, default=1.0)}


def _glm4_moe(m: _Meta, base: dict, tensors: dict) -> dict:
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
    _refuse_scaling(m)
    return {**moe, "num_layers": L, "rotary_dim": 0 if rotary == head_dim else rotary, "o_bias": False,
            "qk_norm": "blk.0.attn_q_norm.weight" in tensors}


def _gpt_oss(m: _Meta, base: dict, tensors: dict) -> dict:
    L = base["num_layers"]
    window = m.scalar("attention.sliding_window", required=True)
    out: dict = {"sliding_window": window or None,
                 "layer_types": _layer_types(m, L, window, _SWA_PERIOD["gpt-oss"]) or ("full_attention",) * L,
                 "num_experts": m.scalar("expert_count", required=True),
                 "num_experts_per_tok": m.scalar("expert_used_count", required=True),
                 "moe_intermediate_size": m.scalar("expert_feed_forward_length", required=True),
                 "norm_topk_prob": True,
                 # llama.cpp's gpt-oss experts: the clamped SwiGLU with alpha 1.702 and limit 7 (fixed)
                 "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
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


_READERS: dict[str, Callable] = {"gemma2": _gemma, "gemma3": _gemma, "phi3": _phi3, "smollm3": _smollm3,
                                 "olmo2": _olmo2, "granite": _granite, "glm4moe": _glm4_moe, "gpt-oss": _gpt_oss}


def with_longrope_factors(arch: ArchConfig, by_name: dict, path: str) -> ArchConfig:
    """Phi-3's ``rope_factors_short`` / ``rope_factors_long`` tensors (``by_name``: GGUF tensors
    by name) into its ``RopeScaling``."""
    # Imported only once a GGUF file is read: an install without the gguf package loads HF folders.
    from gguf.quants import dequantize
    n = arch.rope_dim // 2
    factors = {}
    for key, tname in (("long_factor", "rope_factors_long.weight"), ("short_factor", "rope_factors_short.weight")):
        t = by_name[tname]
        v = np.asarray(dequantize(t.data, t.tensor_type), np.float64).reshape(-1)
        if v.size != n:
            raise ModelLoadError(f"{path}: tensor {tname!r} has {v.size} factors, expected {n} "
                                 f"(rope dims {arch.rope_dim} / 2)")
        factors[key] = tuple(float(x) for x in v)
    return replace(arch, rope_scaling=replace(arch.rope_scaling, **factors))


__all__ = ["ARCHITECTURES", "PHI3_FACTORS", "arch_config", "with_longrope_factors"]

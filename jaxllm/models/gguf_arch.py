"""GGUF files of the families llama.cpp writes with their own architecture names: Gemma 2/3,
Phi-3, SmolLM3, OLMo 2/3, Granite, GLM-4-MoE and GPT-OSS.

``models/loader.load_gguf`` hands a file whose ``general.architecture`` is one of
:data:`ARCHITECTURES` to :func:`load`.  For each architecture this module knows

* the metadata llama.cpp's ``convert_hf_to_gguf.py`` writes and how ``llama-model.cpp``
  reads it back, turned into the same ``ArchConfig`` the safetensors twin gives: soft caps,
  sliding windows and their per-layer pattern (``attention.sliding_window_pattern``, else
  llama.cpp's fixed pattern of the architecture), rope bases and scaling, attention scales,
  multipliers, expert routing.  A key under ``<arch>.`` that is not understood is refused by
  name: it could change the function;
* the tensor names, and the undoing of what the converter did to the weights: Q/K rows (and
  biases) permuted for interleaved RoPE (SmolLM3 and Granite, which llama.cpp runs as
  Llama), ``1`` added to every Gemma norm (``Gemma*Model.modify_tensors``), Phi-3's fused
  ``attn_qkv`` / ``ffn_up`` split, GPT-OSS's interleaved ``gate_up_proj`` split into
  ``ffn_gate_exps`` / ``ffn_up_exps`` and every expert matrix transposed to ``[out, in]``,
  GLM-4-MoE's experts merged into ``[E, ...]`` stacks and its multi-token-prediction block
  appended after the decoder's.

Quantized and 16-bit matrices stay in their blocks (``quant/gguf_blocks``) when the
parameter is a 2-D matrix and the undoing is a row operation (permutation, split);
everything else (norms, expert stacks, transposed tensors) is dequantized to float32.
Every tensor must be consumed and every parameter filled with the right shape: a missing
one is reported under its GGUF name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxllm.errors import ModelLoadError
from jaxllm.models.config import ArchConfig, RopeScaling, rope_scaling_from_dict
from jaxllm.models.gguf_tensors import dequantize_all, keeps_packed, map_rows, unpermute_rope_rows
from jaxllm.models.params import GLOBAL

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

# Transforms of a stored tensor back to our parameter (see _convert).
AS_IS, ROPE_Q, ROPE_K, MINUS_ONE, SPLIT_QKV, SPLIT_GATE_UP, EXPERTS_T = (
    "as_is", "rope_q", "rope_k", "minus_one", "split_qkv", "split_gate_up", "experts_t")
GATE_UP_PAIR = "gate_up_pair"      # GPT-OSS: gate and up tensors interleaved into one parameter
ROW_OPS = (AS_IS, ROPE_Q, ROPE_K, SPLIT_QKV, SPLIT_GATE_UP)
"""Transforms that only reorder or select rows: a packed weight takes them field by field."""


@dataclass(frozen=True)
class Rule:
    gguf: str                      # "blk.{layer}.attn_q.weight"; no "{layer}": a global
    params: tuple[str, ...]        # the parameter(s) it gives (two or three for a split)
    transform: str = AS_IS
    slot: int = 0                  # GATE_UP_PAIR: 0 gate, 1 up


def _blk(suffix: str) -> str:
    return "blk.{layer}." + suffix


def _rules(*items) -> tuple[Rule, ...]:
    return tuple(Rule(g, (p,) if isinstance(p, str) else tuple(p), *rest) for g, p, *rest in items)


_GLOBALS = (("token_embd.weight", "embed"), ("output_norm.weight", "final_norm"), ("output.weight", "lm_head"))


def _attention(q=ROPE_Q, k=ROPE_K):
    return (
        (_blk("attn_q.weight"), "q", q), (_blk("attn_k.weight"), "k", k), (_blk("attn_v.weight"), "v"),
        (_blk("attn_output.weight"), "o"),
        (_blk("attn_q.bias"), "q_bias", q), (_blk("attn_k.bias"), "k_bias", k), (_blk("attn_v.bias"), "v_bias"),
        (_blk("attn_output.bias"), "o_bias"),
    )


_MLP = ((_blk("ffn_gate.weight"), "gate"), (_blk("ffn_up.weight"), "up"), (_blk("ffn_down.weight"), "down"))

_GEMMA = _rules(
    ("token_embd.weight", "embed"), ("output_norm.weight", "final_norm", MINUS_ONE), ("output.weight", "lm_head"),
    *_attention(AS_IS, AS_IS), *_MLP,
    (_blk("attn_norm.weight"), "input_norm", MINUS_ONE), (_blk("post_attention_norm.weight"), "post_norm", MINUS_ONE),
    (_blk("ffn_norm.weight"), "pre_ffn_norm", MINUS_ONE), (_blk("post_ffw_norm.weight"), "post_ffn_norm", MINUS_ONE),
    (_blk("attn_q_norm.weight"), "q_norm", MINUS_ONE), (_blk("attn_k_norm.weight"), "k_norm", MINUS_ONE),
)

# The Llama-family decoder of models/llama.py, run by llama.cpp as Llama (Q/K permuted).
_LLAMA_PERMUTED = _rules(
    *_GLOBALS, *_attention(), *_MLP,
    (_blk("attn_norm.weight"), "input_norm"), (_blk("ffn_norm.weight"), "post_norm"),
)

_PHI3 = _rules(
    *_GLOBALS,
    (_blk("attn_qkv.weight"), ("q", "k", "v"), SPLIT_QKV), (_blk("attn_output.weight"), "o"),
    (_blk("ffn_up.weight"), ("gate", "up"), SPLIT_GATE_UP), (_blk("ffn_down.weight"), "down"),
    (_blk("attn_norm.weight"), "input_norm"), (_blk("ffn_norm.weight"), "post_norm"),
)

_OLMO2 = _rules(
    *_GLOBALS, *_attention(AS_IS, AS_IS), *_MLP,
    (_blk("post_attention_norm.weight"), "post_norm"), (_blk("post_ffw_norm.weight"), "post_ffn_norm"),
    (_blk("attn_q_norm.weight"), "q_norm_full"), (_blk("attn_k_norm.weight"), "k_norm_full"),
)

_GLM4_MOE = _rules(
    *_GLOBALS, *_attention(AS_IS, AS_IS), *_MLP,
    (_blk("attn_norm.weight"), "input_norm"), (_blk("post_attention_norm.weight"), "post_norm"),
    (_blk("attn_q_norm.weight"), "q_norm"), (_blk("attn_k_norm.weight"), "k_norm"),
    (_blk("ffn_gate_inp.weight"), "router"), (_blk("exp_probs_b.bias"), "router_bias"),
    (_blk("ffn_gate_exps.weight"), "experts_gate"), (_blk("ffn_up_exps.weight"), "experts_up"),
    (_blk("ffn_down_exps.weight"), "experts_down"),
    (_blk("ffn_gate_shexp.weight"), "shared_gate"), (_blk("ffn_up_shexp.weight"), "shared_up"),
    (_blk("ffn_down_shexp.weight"), "shared_down"),
)

_GPT_OSS = _rules(
    *_GLOBALS, *_attention(AS_IS, AS_IS),
    (_blk("attn_norm.weight"), "input_norm"), (_blk("post_attention_norm.weight"), "post_norm"),
    (_blk("attn_sinks.weight"), "sinks"),
    (_blk("ffn_gate_inp.weight"), "router"), (_blk("ffn_gate_inp.bias"), "router_bias"),
    (_blk("ffn_gate_exps.weight"), "experts_gate_up", GATE_UP_PAIR, 0),
    (_blk("ffn_up_exps.weight"), "experts_gate_up", GATE_UP_PAIR, 1),
    (_blk("ffn_gate_exps.bias"), "experts_gate_up_bias", GATE_UP_PAIR, 0),
    (_blk("ffn_up_exps.bias"), "experts_gate_up_bias", GATE_UP_PAIR, 1),
    (_blk("ffn_down_exps.weight"), "experts_down", EXPERTS_T),
    (_blk("ffn_down_exps.bias"), "experts_down_bias"),
)

TENSOR_RULES = {"gemma2": _GEMMA, "gemma3": _GEMMA, "phi3": _PHI3, "smollm3": _LLAMA_PERMUTED,
                "olmo2": _OLMO2, "granite": _LLAMA_PERMUTED, "glm4moe": _GLM4_MOE, "gpt-oss": _GPT_OSS}

# Phi-3's LongRoPE factors: read into the config, not parameters.
_PHI3_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


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
    have = [n for n in _PHI3_FACTORS if n in tensors]
    if have:
        if len(have) != 2:
            missing = next(n for n in _PHI3_FACTORS if n not in tensors)
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
    from jaxllm.models.families_b import glm4_moe_fields
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
        from jaxllm.models.gpt_oss import ROPE_TYPES
        out["rope_scaling"] = rope_scaling_from_dict(d, m.path, ROPE_TYPES)
    elif t not in (None, "none"):
        raise ModelLoadError(f"{m.path}: gpt-oss.rope.scaling.type {t!r} is not supported (none, yarn)")
    return out


_READERS: dict[str, Callable] = {"gemma2": _gemma, "gemma3": _gemma, "phi3": _phi3, "smollm3": _smollm3,
                                 "olmo2": _olmo2, "granite": _granite, "glm4moe": _glm4_moe, "gpt-oss": _gpt_oss}


# ------------------------------------------------------------------ tensors

def _rows(a, lo: int, hi: int):
    """Rows [lo, hi) of a float matrix or a packed weight (every field alike)."""
    from jaxllm.quant import ops
    if ops.is_quantized(a):
        return ops.map_fields(a, lambda f: f[lo:hi], shape=(hi - lo, a.shape[1]))
    return a[lo:hi]


def _shape(a) -> tuple[int, ...]:
    return tuple(int(n) for n in a.shape)


def _convert(rule: Rule, arch: ArchConfig, a, name: str, path: str) -> list[tuple[str, object]]:
    """(parameter, array) pairs the stored tensor ``a`` gives under ``rule``."""
    t = rule.transform
    if t == AS_IS or t == GATE_UP_PAIR:
        return [(rule.params[0], a)]
    if t == ROPE_Q:
        return [(rule.params[0], map_rows(a, lambda x: unpermute_rope_rows(x, arch.num_heads)))]
    if t == ROPE_K:
        return [(rule.params[0], map_rows(a, lambda x: unpermute_rope_rows(x, arch.num_kv_heads)))]
    if t == MINUS_ONE:
        return [(rule.params[0], a - np.float32(1.0))]
    if t == EXPERTS_T:
        return [(rule.params[0], np.ascontiguousarray(np.swapaxes(a, -1, -2)))]
    if t == SPLIT_QKV:
        sizes = (arch.q_size, arch.kv_size, arch.kv_size)
        if _shape(a)[0] != sum(sizes):
            raise ModelLoadError(f"{path}: tensor {name!r} has {_shape(a)[0]} rows, expected {sum(sizes)} "
                                 f"(q {sizes[0]} + k {sizes[1]} + v {sizes[2]})")
        bounds = np.cumsum((0,) + sizes)
        return [(p, _rows(a, int(bounds[i]), int(bounds[i + 1]))) for i, p in enumerate(rule.params)]
    if t == SPLIT_GATE_UP:
        F = arch.intermediate_size
        if _shape(a)[0] != 2 * F:
            raise ModelLoadError(f"{path}: tensor {name!r} has {_shape(a)[0]} rows, expected {2 * F} (gate and up)")
        return [(rule.params[0], _rows(a, 0, F)), (rule.params[1], _rows(a, F, 2 * F))]
    raise AssertionError(t)


class _Names:
    """GGUF tensor names <-> rules, for one architecture and layer count."""

    def __init__(self, gguf_arch: str):
        self.rules = TENSOR_RULES[gguf_arch]
        self._by_key = {tuple("#" if c == "{layer}" else c for c in r.gguf.split(".")): r for r in self.rules}
        self._source: dict[str, Rule] = {}
        for r in self.rules:
            for p in r.params:
                self._source.setdefault(p, r)

    def lookup(self, name: str) -> tuple[Rule | None, int | None]:
        parts = name.split(".")
        layer = None
        key = []
        for c in parts:
            if c.isascii() and c.isdigit() and layer is None:
                layer = int(c)
                key.append("#")
            else:
                key.append(c)
        return self._by_key.get(tuple(key)), layer

    def source(self, param: str, layer: int | None, slot: int = 0) -> str:
        """The GGUF name a parameter is read from (the gate's, for GPT-OSS's pair: ``slot``)."""
        if slot:
            r = next(r for r in self.rules if param in r.params and r.slot == slot)
        else:
            r = self._source.get(param)
            if r is None:
                return param
        return r.gguf.format(layer=layer)


def load(reader, path: str, name: str | None, dequantize: bool):
    """The ``LoadedModel`` of a GGUF file (``reader``: ``gguf_file.read_gguf(path)``) of one of
    :data:`ARCHITECTURES`."""
    from gguf.quants import dequantize as gguf_dequantize

    from jaxllm.layers.rotary import inv_frequencies
    from jaxllm.models.loader import LoadedModel, TokenizerSource, _rope_tables
    from jaxllm.models.registry import get_model_module
    from jaxllm.quant import gguf_blocks

    gguf_arch = reader.fields["general.architecture"]
    by_name = {t.name: t for t in reader.tensors}
    arch = arch_config(reader.fields, {n: t.shape for n, t in by_name.items()}, gguf_arch, path)
    table = get_model_module(arch.architecture).PARAMS
    names = _Names(gguf_arch)
    base = os.path.basename(path)

    if gguf_arch == "phi3" and arch.longrope:
        arch = _with_longrope_factors(arch, by_name, gguf_dequantize, path)

    want = {p.name: p for p in table.present(arch) if p.from_checkpoint}
    placed: dict[tuple[int | None, str], object] = {}
    given: dict[tuple[int | None, str], str] = {}
    pairs: dict[tuple[int, str], dict[int, tuple[np.ndarray, str]]] = {}

    def place(layer, param, arr, source):
        p = want.get(param)
        if p is None or (layer is not None and not p.has(arch, layer)) or (p.scope == GLOBAL) != (layer is None):
            where = "" if layer is None else f" of layer {layer}"
            raise ModelLoadError(f"{path}: unexpected tensor {source!r} (no parameter {param}{where} in "
                                 f"{arch.architecture} with {arch.num_layers} layers in this config)")
        if (layer, param) in given:
            raise ModelLoadError(f"{path}: tensor {source!r} gives {param} of layer {layer} a second time "
                                 f"(also from {given[layer, param]!r})")
        shape = tuple(p.shape(arch))
        if _shape(arr) != shape:
            raise ModelLoadError(f"{path}: tensor {source!r} gives {param} of shape {_shape(arr)}, expected {shape}")
        given[layer, param] = source
        placed[layer, param] = arr

    # Pass 1: each tensor's rule, and whether it stays in its blocks or is decoded.
    todo = []   # (tensor, rule, layer, logical shape, packed)
    for t in reader.tensors:
        if gguf_arch == "phi3" and t.name in _PHI3_FACTORS and arch.longrope:
            continue
        rule, layer = names.lookup(t.name)
        if gguf_arch == "glm4moe" and t.name.startswith("blk.") and layer is not None and layer >= arch.num_layers:
            continue   # GLM-4-MoE's multi-token-prediction block(s), nextn.* included (transformers skips them too)
        if rule is None or ("{layer}" in rule.gguf) != (layer is not None) or (
                layer is not None and layer >= arch.num_layers):
            raise ModelLoadError(f"{path}: unexpected tensor {t.name!r} (not a tensor of {gguf_arch} with "
                                 f"{arch.num_layers} layers)")
        shape = tuple(int(n) for n in reversed(t.shape))   # GGUF lists dims innermost first
        params = [want.get(p) for p in rule.params]
        packed = rule.transform in ROW_OPS and len(shape) == 2 and keeps_packed(t, params, arch, dequantize)
        todo.append((t, rule, layer, shape, packed))

    # Pass 2: the rest decoded (in parallel).
    floats = dequantize_all([t for t, *_, packed in todo if not packed], path)

    # Pass 3: undo the converter's changes and place each parameter.
    for t, rule, layer, shape, packed in todo:
        if packed:
            arr = gguf_blocks.pack(t.data, t.tensor_type, shape)
        else:
            arr = floats.pop(t.name).reshape(shape)
        if rule.transform == GATE_UP_PAIR:
            pairs.setdefault((layer, rule.params[0]), {})[rule.slot] = (arr, t.name)
            continue
        for param, a in _convert(rule, arch, arr, t.name, path):
            place(layer, param, a, t.name)

    # GPT-OSS: gate and up back into the checkpoint's interleaved [E, D, 2F] (bias [E, 2F]).
    for (layer, param), got in sorted(pairs.items()):
        for slot in (0, 1):
            if slot not in got:
                raise ModelLoadError(f"{path}: missing tensor {names.source(param, layer, slot)!r}")
        (gate, gname), (up, _) = got[0], got[1]
        if gate.shape != up.shape:
            raise ModelLoadError(f"{path}: tensor {gname!r} has shape {gate.shape}, its up twin {up.shape}")
        if param == "experts_gate_up":   # stored [E, F, D] each
            gate, up = np.swapaxes(gate, -1, -2), np.swapaxes(up, -1, -2)
        both = np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])
        place(layer, param, np.ascontiguousarray(both), gname)

    for p in want.values():
        for layer in ([None] if p.scope == GLOBAL else range(arch.num_layers)):
            if (layer, p.name) not in placed and p.has(arch, layer):
                raise ModelLoadError(f"{path}: missing tensor {names.source(p.name, layer)!r}")

    layers = [{} for _ in range(arch.num_layers)]
    globals_ = {}
    for (layer, param), a in placed.items():
        (globals_ if layer is None else layers[layer])[param] = a
    return LoadedModel(
        name=name or path, arch=arch, layers=layers, globals=globals_,
        rope_inv_freq=inv_frequencies(arch.rope_dim, arch.rope_theta, arch.rope_scaling),
        tokenizer=TokenizerSource(os.path.dirname(os.path.abspath(path)), gguf_file=base),
        generation_config={}, rope_tables=_rope_tables(arch))


def _with_longrope_factors(arch: ArchConfig, by_name: dict, gguf_dequantize, path: str) -> ArchConfig:
    """Phi-3's ``rope_factors_short`` / ``rope_factors_long`` tensors into its ``RopeScaling``."""
    from dataclasses import replace
    n = arch.rope_dim // 2
    factors = {}
    for key, tname in (("long_factor", "rope_factors_long.weight"), ("short_factor", "rope_factors_short.weight")):
        t = by_name[tname]
        v = np.asarray(gguf_dequantize(t.data, t.tensor_type), np.float64).reshape(-1)
        if v.size != n:
            raise ModelLoadError(f"{path}: tensor {tname!r} has {v.size} factors, expected {n} "
                                 f"(rope dims {arch.rope_dim} / 2)")
        factors[key] = tuple(float(x) for x in v)
    return replace(arch, rope_scaling=replace(arch.rope_scaling, **factors))


__all__ = ["ARCHITECTURES", "TENSOR_RULES", "arch_config", "load"]

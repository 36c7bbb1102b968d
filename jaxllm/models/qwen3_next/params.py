"""The hybrid family's parameter table (safetensors names; no GGUF mapping) and the conv
channels' order it keeps (:func:`grouped_channels`)."""

from __future__ import annotations

import numpy as np

from jaxllm.models.params import (
    GLOBAL,
    LAYER,
    MATRIX,
    VECTOR,
    Chunk,
    Param,
    ParamTable,
    always,
)
from jaxllm.models.qwen3_next.config import HybridConfig


def _hf(suffix: str) -> str:
    return "model.layers.{layer}." + suffix


def _linear_layer(a: HybridConfig, i: int) -> bool:
    return a.is_linear(i)


def _full_layer(a: HybridConfig, i: int) -> bool:
    return not a.is_linear(i)


def _moe_layer(a: HybridConfig, i: int) -> bool:
    return a.moe_layers[i]


def _dense_layer(a: HybridConfig, i: int) -> bool:
    return not a.moe_layers[i]


def _fused(a: HybridConfig) -> bool:
    return a.fused_projections


def _split(a: HybridConfig) -> bool:
    return not a.fused_projections


def grouped_channels(a: HybridConfig) -> np.ndarray:
    """[C] the conv channels in the order this module keeps them, as indices into the
    checkpoint's (every q head, every k head, every v head): per key head its q, its k and
    the v heads of its group, so a split into whole key-head groups (tensor parallelism)
    gives each device the channels of its own heads and nothing else."""
    Hk, Dk, Dv = a.linear_num_key_heads, a.linear_key_head_dim, a.linear_value_head_dim
    gv = a.linear_num_value_heads // Hk * Dv                               # one group's v channels
    return np.concatenate([np.r_[g * Dk:(g + 1) * Dk, a.key_dim + g * Dk:a.key_dim + (g + 1) * Dk,
                                 2 * a.key_dim + g * gv:2 * a.key_dim + (g + 1) * gv] for g in range(Hk)])


_IN_QKV = _hf("linear_attn.in_proj_qkv.weight")     # Qwen3.5: [2 Kd + Vd, D], q then k then v rows
_FUSED_GATE_UP = _hf("mlp.experts.gate_up_proj")    # transformers 5's fused experts: [E, 2F, D]

PARAMS = ParamTable(params=(
    Param("embed", GLOBAL, MATRIX, ("vocab", "embed"), lambda a: (a.vocab_size, a.hidden_size),
          "model.embed_tokens.weight", native=lambda a: a.tie_word_embeddings),
    Param("final_norm", GLOBAL, VECTOR, ("embed",), lambda a: (a.hidden_size,), "model.norm.weight"),
    Param("lm_head", GLOBAL, MATRIX, ("vocab", "embed"), lambda a: (a.vocab_size, a.hidden_size),
          "lm_head.weight", when=lambda a: not a.tie_word_embeddings, native=always),
    Param("rope_inv_freq", GLOBAL, VECTOR, ("rotary",), lambda a: (a.rotary_dim // 2,), from_checkpoint=False),
    Param("input_norm", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,), _hf("input_layernorm.weight")),
    Param("post_norm", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,),
          _hf("post_attention_layernorm.weight")),
    # Full-attention layers.  q: each head's query rows then its gate rows ([H, 2, Dh] flattened).
    Param("q", LAYER, MATRIX, ("q_heads", "embed"), lambda a: (2 * a.num_heads * a.head_dim, a.hidden_size),
          _hf("self_attn.q_proj.weight"), in_layer=_full_layer, native=always),
    Param("k", LAYER, MATRIX, ("kv_heads", "embed"), lambda a: (a.num_kv_heads * a.head_dim, a.hidden_size),
          _hf("self_attn.k_proj.weight"), in_layer=_full_layer, native=always),
    Param("v", LAYER, MATRIX, ("kv_heads", "embed"), lambda a: (a.num_kv_heads * a.head_dim, a.hidden_size),
          _hf("self_attn.v_proj.weight"), in_layer=_full_layer, native=always),
    Param("o", LAYER, MATRIX, ("embed", "q_heads"), lambda a: (a.hidden_size, a.num_heads * a.head_dim),
          _hf("self_attn.o_proj.weight"), in_layer=_full_layer, native=always),
    Param("q_norm", LAYER, VECTOR, ("head_dim",), lambda a: (a.head_dim,), _hf("self_attn.q_norm.weight"),
          in_layer=_full_layer),
    Param("k_norm", LAYER, VECTOR, ("head_dim",), lambda a: (a.head_dim,), _hf("self_attn.k_norm.weight"),
          in_layer=_full_layer),
    # GDN layers, Qwen3-Next's fused projections: per key-head group [q, k, v heads, z heads] / [b, a].
    Param("in_qkvz", LAYER, MATRIX, ("gdn_heads", "embed"),
          lambda a: (2 * a.key_dim + 2 * a.value_dim, a.hidden_size), _hf("linear_attn.in_proj_qkvz.weight"),
          when=_fused, in_layer=_linear_layer, native=always),
    Param("in_ba", LAYER, MATRIX, ("gdn_heads", "embed"), lambda a: (2 * a.linear_num_value_heads, a.hidden_size),
          _hf("linear_attn.in_proj_ba.weight"), when=_fused, in_layer=_linear_layer, native=always),
    # Qwen3.5's: the conv channels' rows (regrouped by key head at load), z, b, a.
    Param("in_qkv", LAYER, MATRIX, ("gdn_heads", "embed"), lambda a: (a.conv_dim, a.hidden_size), _IN_QKV,
          when=_split, in_layer=_linear_layer, native=always, row_order=grouped_channels),
    Param("in_z", LAYER, MATRIX, ("gdn_heads", "embed"), lambda a: (a.value_dim, a.hidden_size),
          _hf("linear_attn.in_proj_z.weight"), when=_split, in_layer=_linear_layer, native=always),
    Param("in_b", LAYER, MATRIX, ("gdn_heads", "embed"), lambda a: (a.linear_num_value_heads, a.hidden_size),
          _hf("linear_attn.in_proj_b.weight"), when=_split, in_layer=_linear_layer, native=always),
    Param("in_a", LAYER, MATRIX, ("gdn_heads", "embed"), lambda a: (a.linear_num_value_heads, a.hidden_size),
          _hf("linear_attn.in_proj_a.weight"), when=_split, in_layer=_linear_layer, native=always),
    # The depthwise conv over the q, k, v channels: [C, 1, K] as nn.Conv1d stores it, regrouped.
    Param("conv", LAYER, VECTOR, ("gdn_heads", None, None), lambda a: (a.conv_dim, 1, a.conv_kernel),
          _hf("linear_attn.conv1d.weight"), in_layer=_linear_layer, row_order=grouped_channels),
    Param("dt_bias", LAYER, VECTOR, ("gdn_value_heads",), lambda a: (a.linear_num_value_heads,),
          _hf("linear_attn.dt_bias"), in_layer=_linear_layer),
    Param("A_log", LAYER, VECTOR, ("gdn_value_heads",), lambda a: (a.linear_num_value_heads,),
          _hf("linear_attn.A_log"), in_layer=_linear_layer),
    Param("gdn_norm", LAYER, VECTOR, ("head_dim",), lambda a: (a.linear_value_head_dim,),
          _hf("linear_attn.norm.weight"), in_layer=_linear_layer),
    Param("out", LAYER, MATRIX, ("embed", "gdn_heads"), lambda a: (a.hidden_size, a.value_dim),
          _hf("linear_attn.out_proj.weight"), in_layer=_linear_layer, native=always),
    # Dense SwiGLU MLP.
    Param("gate", LAYER, MATRIX, ("mlp", "embed"), lambda a: (a.intermediate_size, a.hidden_size),
          _hf("mlp.gate_proj.weight"), in_layer=_dense_layer, native=always),
    Param("up", LAYER, MATRIX, ("mlp", "embed"), lambda a: (a.intermediate_size, a.hidden_size),
          _hf("mlp.up_proj.weight"), in_layer=_dense_layer, native=always),
    Param("down", LAYER, MATRIX, ("embed", "mlp"), lambda a: (a.hidden_size, a.intermediate_size),
          _hf("mlp.down_proj.weight"), in_layer=_dense_layer, native=always),
    # Sparse MoE: router, experts (per-expert tensors or transformers 5's fused stacks), shared expert.
    Param("router", LAYER, MATRIX, ("expert_logits", "embed"), lambda a: (a.num_experts, a.hidden_size),
          _hf("mlp.gate.weight"), when=lambda a: a.is_moe, in_layer=_moe_layer),
    Param("experts_gate", LAYER, MATRIX, ("expert", "moe_mlp", "embed"),
          lambda a: (a.num_experts, a.moe_intermediate_size, a.hidden_size),
          (_hf("mlp.experts.{expert}.gate_proj.weight"), Chunk(_FUSED_GATE_UP, 0, 2, 1)),
          when=lambda a: a.is_moe, in_layer=_moe_layer),
    Param("experts_up", LAYER, MATRIX, ("expert", "moe_mlp", "embed"),
          lambda a: (a.num_experts, a.moe_intermediate_size, a.hidden_size),
          (_hf("mlp.experts.{expert}.up_proj.weight"), Chunk(_FUSED_GATE_UP, 1, 2, 1)),
          when=lambda a: a.is_moe, in_layer=_moe_layer),
    Param("experts_down", LAYER, MATRIX, ("expert", "embed", "moe_mlp"),
          lambda a: (a.num_experts, a.hidden_size, a.moe_intermediate_size),
          (_hf("mlp.experts.{expert}.down_proj.weight"), _hf("mlp.experts.down_proj")),
          when=lambda a: a.is_moe, in_layer=_moe_layer),
    Param("shared_gate", LAYER, MATRIX, ("moe_mlp", "embed"),
          lambda a: (a.shared_expert_intermediate_size, a.hidden_size), _hf("mlp.shared_expert.gate_proj.weight"),
          when=lambda a: a.is_moe, in_layer=_moe_layer, native=always),
    Param("shared_up", LAYER, MATRIX, ("moe_mlp", "embed"),
          lambda a: (a.shared_expert_intermediate_size, a.hidden_size), _hf("mlp.shared_expert.up_proj.weight"),
          when=lambda a: a.is_moe, in_layer=_moe_layer, native=always),
    Param("shared_down", LAYER, MATRIX, ("embed", "moe_mlp"),
          lambda a: (a.hidden_size, a.shared_expert_intermediate_size), _hf("mlp.shared_expert.down_proj.weight"),
          when=lambda a: a.is_moe, in_layer=_moe_layer, native=always),
    Param("shared_expert_gate", LAYER, MATRIX, (None, "embed"), lambda a: (1, a.hidden_size),
          _hf("mlp.shared_expert_gate.weight"), when=lambda a: a.is_moe, in_layer=_moe_layer),
))
"""The hybrid family's parameters (safetensors names; no GGUF mapping)."""

"""DeepSeek-V2/V3's parameter table: every weight with its HF safetensors names (no GGUF mapping)."""

from __future__ import annotations

from jaxllm.models.config import ArchConfig
from jaxllm.models.params import GLOBAL, LAYER, MATRIX, VECTOR, Chunk, Param, ParamTable, always



def _hf(suffix: str) -> str:
    return "model.layers.{layer}." + suffix


def _dense_layer(a: ArchConfig, i: int) -> bool:
    return not a.layer_is_moe(i)


def _moe_layer(a: ArchConfig, i: int) -> bool:
    return a.layer_is_moe(i)


def _qk_head(a: ArchConfig) -> int:
    return a.mla.qk_nope_head_dim + a.head_dim


_FUSED_GATE_UP = _hf("mlp.experts.gate_up_proj")   # transformers 5's fused experts [E, 2F, D]

PARAMS = ParamTable(params=(
    Param("embed", GLOBAL, MATRIX, ("vocab", "embed"), lambda a: (a.vocab_size, a.hidden_size),
          "model.embed_tokens.weight", native=lambda a: a.tie_word_embeddings),
    Param("final_norm", GLOBAL, VECTOR, ("embed",), lambda a: (a.hidden_size,), "model.norm.weight"),
    Param("lm_head", GLOBAL, MATRIX, ("vocab", "embed"), lambda a: (a.vocab_size, a.hidden_size),
          "lm_head.weight", when=lambda a: not a.tie_word_embeddings, native=always),
    Param("rope_inv_freq", GLOBAL, VECTOR, ("rotary",), lambda a: (a.head_dim // 2,), from_checkpoint=False),
    Param("input_norm", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,), _hf("input_layernorm.weight")),
    # The query: one projection, or the low-rank pair with its norm.  Rows are head-major.
    Param("q", LAYER, MATRIX, ("q_heads", "embed"), lambda a: (a.num_heads * _qk_head(a), a.hidden_size),
          _hf("self_attn.q_proj.weight"), when=lambda a: not a.mla.q_lora_rank, native=always),
    Param("q_a", LAYER, MATRIX, ("q_lora", "embed"), lambda a: (a.mla.q_lora_rank, a.hidden_size),
          _hf("self_attn.q_a_proj.weight"), when=lambda a: bool(a.mla.q_lora_rank), native=always),
    Param("q_a_norm", LAYER, VECTOR, ("q_lora",), lambda a: (a.mla.q_lora_rank,),
          _hf("self_attn.q_a_layernorm.weight"), when=lambda a: bool(a.mla.q_lora_rank)),
    Param("q_b", LAYER, MATRIX, ("q_heads", "q_lora"), lambda a: (a.num_heads * _qk_head(a), a.mla.q_lora_rank),
          _hf("self_attn.q_b_proj.weight"), when=lambda a: bool(a.mla.q_lora_rank), native=always),
    # The latent and the shared rotary key, [R + Dr, D]; the latent's norm.
    Param("kv_a", LAYER, MATRIX, ("kv_lora", "embed"), lambda a: (a.mla.kv_lora_rank + a.head_dim, a.hidden_size),
          _hf("self_attn.kv_a_proj_with_mqa.weight"), native=always),
    Param("kv_a_norm", LAYER, VECTOR, ("kv_lora",), lambda a: (a.mla.kv_lora_rank,), _hf("self_attn.kv_a_layernorm.weight")),
    # W_UK and W_UV of every head, [H * (Dn + Dv), R]: read per head by the absorbed form
    # (an einsum, never the native matmul).
    Param("kv_b", LAYER, MATRIX, ("q_heads", "kv_lora"),
          lambda a: (a.num_heads * (a.mla.qk_nope_head_dim + a.mla.v_head_dim), a.mla.kv_lora_rank),
          _hf("self_attn.kv_b_proj.weight")),
    Param("o", LAYER, MATRIX, ("embed", "q_heads"), lambda a: (a.hidden_size, a.num_heads * a.mla.v_head_dim),
          _hf("self_attn.o_proj.weight"), native=always),
    Param("post_norm", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,), _hf("post_attention_layernorm.weight")),
    Param("gate", LAYER, MATRIX, ("mlp", "embed"), lambda a: (a.intermediate_size, a.hidden_size),
          _hf("mlp.gate_proj.weight"), when=lambda a: a.dense_mlp, in_layer=_dense_layer, native=always),
    Param("up", LAYER, MATRIX, ("mlp", "embed"), lambda a: (a.intermediate_size, a.hidden_size),
          _hf("mlp.up_proj.weight"), when=lambda a: a.dense_mlp, in_layer=_dense_layer, native=always),
    Param("down", LAYER, MATRIX, ("embed", "mlp"), lambda a: (a.hidden_size, a.intermediate_size),
          _hf("mlp.down_proj.weight"), when=lambda a: a.dense_mlp, in_layer=_dense_layer, native=always),
    Param("router", LAYER, MATRIX, ("expert_logits", "embed"), lambda a: (a.num_experts, a.hidden_size),
          _hf("mlp.gate.weight"), in_layer=_moe_layer),
    Param("router_bias", LAYER, VECTOR, ("expert_logits",), lambda a: (a.num_experts,),
          _hf("mlp.gate.e_score_correction_bias"), when=lambda a: a.moe.router_scoring == "sigmoid", in_layer=_moe_layer),
    Param("shared_gate", LAYER, MATRIX, ("moe_mlp", "embed"),
          lambda a: (a.moe.shared_experts * a.moe_intermediate_size, a.hidden_size),
          _hf("mlp.shared_experts.gate_proj.weight"), when=lambda a: a.moe.shared_experts > 0, in_layer=_moe_layer,
          native=always),
    Param("shared_up", LAYER, MATRIX, ("moe_mlp", "embed"),
          lambda a: (a.moe.shared_experts * a.moe_intermediate_size, a.hidden_size),
          _hf("mlp.shared_experts.up_proj.weight"), when=lambda a: a.moe.shared_experts > 0, in_layer=_moe_layer,
          native=always),
    Param("shared_down", LAYER, MATRIX, ("embed", "moe_mlp"),
          lambda a: (a.hidden_size, a.moe.shared_experts * a.moe_intermediate_size),
          _hf("mlp.shared_experts.down_proj.weight"), when=lambda a: a.moe.shared_experts > 0, in_layer=_moe_layer,
          native=always),
    Param("experts_gate", LAYER, MATRIX, ("expert", "moe_mlp", "embed"),
          lambda a: (a.num_experts, a.moe_intermediate_size, a.hidden_size),
          (_hf("mlp.experts.{expert}.gate_proj.weight"), Chunk(_FUSED_GATE_UP, 0, 2, 1)), in_layer=_moe_layer),
    Param("experts_up", LAYER, MATRIX, ("expert", "moe_mlp", "embed"),
          lambda a: (a.num_experts, a.moe_intermediate_size, a.hidden_size),
          (_hf("mlp.experts.{expert}.up_proj.weight"), Chunk(_FUSED_GATE_UP, 1, 2, 1)), in_layer=_moe_layer),
    Param("experts_down", LAYER, MATRIX, ("expert", "embed", "moe_mlp"),
          lambda a: (a.num_experts, a.hidden_size, a.moe_intermediate_size),
          (_hf("mlp.experts.{expert}.down_proj.weight"), _hf("mlp.experts.down_proj")), in_layer=_moe_layer),
))
"""DeepSeek-V2/V3's parameters (safetensors names; no GGUF mapping)."""

EXPERT_PARAMS = ("experts_gate", "experts_up", "experts_down")

"""GPT-OSS's parameter table: every weight with its HF safetensors and GGUF names (llama.cpp's
converter splits the interleaved gate/up experts in two and stores every expert matrix
``[E, out, in]``: ``params.Stored``)."""

from __future__ import annotations

from jaxllm.models.params import (GLOBAL, LAYER, MATRIX, VECTOR, Fused, Param, ParamTable, Stored, always,
                                  attention_params)


def _hf(suffix: str) -> str:
    return "model.layers.{layer}." + suffix


def _gguf(suffix: str) -> str:
    return "blk.{layer}." + suffix


PARAMS = ParamTable(params=(
    Param("embed", GLOBAL, MATRIX, ("vocab", "embed"), lambda a: (a.vocab_size, a.hidden_size),
          "model.embed_tokens.weight", "token_embd.weight", native=lambda a: a.tie_word_embeddings),
    Param("final_norm", GLOBAL, VECTOR, ("embed",), lambda a: (a.hidden_size,), "model.norm.weight", "output_norm.weight"),
    Param("lm_head", GLOBAL, MATRIX, ("vocab", "embed"), lambda a: (a.vocab_size, a.hidden_size),
          "lm_head.weight", "output.weight", when=lambda a: not a.tie_word_embeddings, native=always),
    Param("rope_inv_freq", GLOBAL, VECTOR, ("rotary",), lambda a: (a.head_dim // 2,), from_checkpoint=False),
    Param("input_norm", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,), _hf("input_layernorm.weight"),
          _gguf("attn_norm.weight")),
    *attention_params(),
    Param("sinks", LAYER, VECTOR, ("q_heads",), lambda a: (a.num_heads,), _hf("self_attn.sinks"), _gguf("attn_sinks.weight")),
    Param("post_norm", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,), _hf("post_attention_layernorm.weight"),
          _gguf("post_attention_norm.weight")),
    Param("router", LAYER, MATRIX, ("expert_logits", "embed"), lambda a: (a.num_experts, a.hidden_size),
          _hf("mlp.router.weight"), _gguf("ffn_gate_inp.weight")),
    Param("router_bias", LAYER, VECTOR, ("expert_logits",), lambda a: (a.num_experts,), _hf("mlp.router.bias"), _gguf("ffn_gate_inp.bias")),
    # Experts in the checkpoint's [E, in, out] layout; gate and up interleaved along 2F.  llama.cpp's
    # converter splits gate and up, and stores every expert matrix [E, out, in].
    Param("experts_gate_up", LAYER, MATRIX, ("expert", "embed", "moe_mlp"),
          lambda a: (a.num_experts, a.hidden_size, 2 * a.moe_intermediate_size), _hf("mlp.experts.gate_up_proj"),
          (Stored(_gguf("ffn_gate_exps.weight"), transposed=True, part=0, parts=2),
           Stored(_gguf("ffn_up_exps.weight"), transposed=True, part=1, parts=2))),
    Param("experts_gate_up_bias", LAYER, VECTOR, ("expert", "moe_mlp"),
          lambda a: (a.num_experts, 2 * a.moe_intermediate_size), _hf("mlp.experts.gate_up_proj_bias"),
          (Stored(_gguf("ffn_gate_exps.bias"), part=0, parts=2), Stored(_gguf("ffn_up_exps.bias"), part=1, parts=2))),
    Param("experts_down", LAYER, MATRIX, ("expert", "moe_mlp", "embed"),
          lambda a: (a.num_experts, a.moe_intermediate_size, a.hidden_size), _hf("mlp.experts.down_proj"),
          Stored(_gguf("ffn_down_exps.weight"), transposed=True)),
    Param("experts_down_bias", LAYER, VECTOR, ("expert", "embed"),
          lambda a: (a.num_experts, a.hidden_size), _hf("mlp.experts.down_proj_bias"), _gguf("ffn_down_exps.bias")),
), fused=(
    Fused("qkv", ("q", "k", "v"), ("fused_qkv", "embed")),
    Fused("qkv_bias", ("q_bias", "k_bias", "v_bias"), ("fused_qkv",)),
))
"""GPT-OSS's parameters (safetensors names, bf16/float32 checkpoints; GGUF names)."""

EXPERT_PARAMS = ("experts_gate_up", "experts_gate_up_bias", "experts_down", "experts_down_bias")

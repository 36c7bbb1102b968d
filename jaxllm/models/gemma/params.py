"""Gemma 2/3's parameter table: every weight with its HF safetensors and GGUF names (llama.cpp's
converter adds 1 to every Gemma norm: ``params.Stored`` with ``offset=1``)."""

from __future__ import annotations

from jaxllm.models.params import (GLOBAL, LAYER, MATRIX, VECTOR, Fused, Param, ParamTable, Stored, always,
                                  attention_params)


def _hf(suffix: str) -> str:
    return "model.layers.{layer}." + suffix


def _gguf(suffix: str) -> str:
    return "blk.{layer}." + suffix


def _norm(name: str) -> Stored:
    """A norm weight in a GGUF: llama.cpp's converter adds 1 to every Gemma norm."""
    return Stored(name, offset=1.0)


def _if(flag: str, value=True):
    return lambda a: getattr(a, flag) == value


PARAMS = ParamTable(params=(
    Param("embed", GLOBAL, MATRIX, ("vocab", "embed"), lambda a: (a.vocab_size, a.hidden_size),
          "model.embed_tokens.weight", "token_embd.weight", native=_if("tie_word_embeddings")),
    Param("final_norm", GLOBAL, VECTOR, ("embed",), lambda a: (a.hidden_size,), "model.norm.weight",
          _norm("output_norm.weight")),
    Param("lm_head", GLOBAL, MATRIX, ("vocab", "embed"), lambda a: (a.vocab_size, a.hidden_size),
          "lm_head.weight", "output.weight", when=_if("tie_word_embeddings", False), native=always),
    Param("rope_inv_freq", GLOBAL, VECTOR, ("rotary",), lambda a: (a.head_dim // 2,), from_checkpoint=False),
    Param("rope_local_inv_freq", GLOBAL, VECTOR, ("rotary",), lambda a: (a.head_dim // 2,), from_checkpoint=False,
          when=lambda a: a.gemma.rope_local_theta is not None),
    Param("input_norm", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,), _hf("input_layernorm.weight"),
          _norm(_gguf("attn_norm.weight"))),
    *attention_params(norm_gguf=_norm, qk_norm=_if("qk_norm")),
    Param("post_norm", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,), _hf("post_attention_layernorm.weight"),
          _norm(_gguf("post_attention_norm.weight"))),
    Param("pre_ffn_norm", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,),
          _hf("pre_feedforward_layernorm.weight"), _norm(_gguf("ffn_norm.weight"))),
    Param("post_ffn_norm", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,),
          _hf("post_feedforward_layernorm.weight"), _norm(_gguf("post_ffw_norm.weight"))),
    Param("gate", LAYER, MATRIX, ("mlp", "embed"), lambda a: (a.intermediate_size, a.hidden_size),
          _hf("mlp.gate_proj.weight"), _gguf("ffn_gate.weight"), native=always),
    Param("up", LAYER, MATRIX, ("mlp", "embed"), lambda a: (a.intermediate_size, a.hidden_size),
          _hf("mlp.up_proj.weight"), _gguf("ffn_up.weight"), native=always),
    Param("down", LAYER, MATRIX, ("embed", "mlp"), lambda a: (a.hidden_size, a.intermediate_size),
          _hf("mlp.down_proj.weight"), _gguf("ffn_down.weight"), native=always),
), fused=(
    Fused("qkv", ("q", "k", "v"), ("fused_qkv", "embed")),
    Fused("qkv_bias", ("q_bias", "k_bias", "v_bias"), ("fused_qkv",)),
    Fused("gate_up", ("gate", "up"), ("fused_mlp", "embed")),
))
"""Gemma 2/3's parameters (safetensors and GGUF names)."""

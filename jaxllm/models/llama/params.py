"""The Llama family's parameter table: every weight of the decoder (and its variants) with its
HF safetensors and GGUF names, declared once (``models/params.py``); loading, sharding and
the device layout are derived from it."""

from __future__ import annotations

from jaxllm.models.config import ArchConfig
from jaxllm.models.llama.config import variant
from jaxllm.models.params import (GLOBAL, LAYER, MATRIX, VECTOR, Chunk, Fused, Param, ParamTable, always,
                                  attention_params)


def _hf(suffix: str) -> str:
    return "model.layers.{layer}." + suffix


def _gguf(suffix: str) -> str:
    return "blk.{layer}." + suffix


def _moe_hf(qwen3: str, mixtral: str, *fused) -> dict:
    """An MoE tensor's HF names: under ``mlp`` in Qwen3-MoE; under ``block_sparse_moe`` (or
    ``mlp``, from newer writers) in Mixtral; ``fused``: transformers 5's fused 3-D expert
    tensors, which either may hold."""
    return {"Qwen3MoeForCausalLM": (_hf("mlp." + qwen3), *fused),
            "Glm4MoeForCausalLM": (_hf("mlp." + qwen3), *fused),
            "MixtralForCausalLM": (_hf("block_sparse_moe." + mixtral), _hf("mlp." + mixtral), *fused)}


def _phi3(plain: str, fused: Chunk) -> dict:
    """A projection Phi-3 checkpoints hold inside a fused tensor (split at load)."""
    return {"*": (_hf(plain),), "Phi3ForCausalLM": (fused,)}


def _qkv_sizes(a: ArchConfig) -> tuple[int, int, int]:
    return a.q_size, a.kv_size, a.kv_size


_QKV = _hf("self_attn.qkv_proj.weight")     # Phi-3: [q_size + 2 * kv_size, D]
_GATE_UP = _hf("mlp.gate_up_proj.weight")    # Phi-3: [2F, D], the gate rows first
_GGUF_QKV = _gguf("attn_qkv.weight")         # Phi-3's GGUF: the same fused tensors
_GGUF_GATE_UP = _gguf("ffn_up.weight")


def _phi3_gguf(plain: str, fused: Chunk) -> dict:
    """A projection Phi-3's GGUF holds inside a fused tensor."""
    return {"*": (_gguf(plain),), "Phi3ForCausalLM": (fused,)}


def _proj_hf(suffix: str, part: int | None):
    """An attention projection's HF names: q/k/v also inside Phi-3's fused ``qkv_proj``."""
    return _hf(suffix) if part is None else _phi3(suffix, Chunk(_QKV, part, 3, 0, _qkv_sizes))


def _proj_gguf(suffix: str, part: int | None):
    """An attention projection's GGUF names: q/k/v also inside Phi-3's fused ``attn_qkv``."""
    return _gguf(suffix) if part is None else _phi3_gguf(suffix, Chunk(_GGUF_QKV, part, 3, 0, _qkv_sizes))


# OLMo 2/3 and GLM-4-MoE: the norm after attention is llama.cpp's post_attention_norm (ffn_norm
# in the others).
_POST_ATTENTION_NORM = {"*": (_gguf("ffn_norm.weight"),),
                        **{a: (_gguf("post_attention_norm.weight"),)
                           for a in ("Olmo2ForCausalLM", "Olmo3ForCausalLM", "Glm4MoeForCausalLM")}}


def _dense_layer(a: ArchConfig, i: int) -> bool:
    return not a.layer_is_moe(i)


def _moe_layer(a: ArchConfig, i: int) -> bool:
    return a.layer_is_moe(i)


def _if(flag: str, value: bool = True):
    """Present when ``ArchConfig.<flag>`` is ``value``."""
    return lambda a: getattr(a, flag) == value


_FUSED_GATE_UP = _hf("mlp.experts.gate_up_proj")   # [E, 2F, D]

PARAMS = ParamTable(params=(
    # name, scope, storage, logical axes, shape, HF names, GGUF names
    # Tied, the embedding is also the LM head.
    Param("embed", GLOBAL, MATRIX, ("vocab", "embed"), lambda a: (a.vocab_size, a.hidden_size),
          "model.embed_tokens.weight", "token_embd.weight", native=_if("tie_word_embeddings")),
    Param("final_norm", GLOBAL, VECTOR, ("embed",), lambda a: (a.hidden_size,),
          "model.norm.weight", "output_norm.weight"),
    Param("lm_head", GLOBAL, MATRIX, ("vocab", "embed"), lambda a: (a.vocab_size, a.hidden_size),
          "lm_head.weight", "output.weight", when=_if("tie_word_embeddings", False), native=always),
    # LongRoPE: the short factors' frequencies, then the long ones'.
    Param("rope_inv_freq", GLOBAL, VECTOR, ("rotary",), lambda a: (a.rope_dim // (1 if a.longrope else 2),),
          from_checkpoint=False),
    Param("input_norm", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,),
          _hf("input_layernorm.weight"), _gguf("attn_norm.weight"), when=lambda a: not variant(a).post_norms_only),
    # q/k rows permuted by llama.cpp's converter for the architectures it runs as Llama
    # (loader.ROPE_PERMUTED); Phi-3 holds q/k/v in one fused tensor.
    *attention_params(proj_hf=_proj_hf, proj_gguf=_proj_gguf, rope_heads=True,
                      qk_norm=lambda a: a.qk_norm and not variant(a).qk_norm_whole),
    # Before the MLP; with ``post_norms_only`` (OLMo 2/3), on the attention's output instead.
    Param("post_norm", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,),
          _hf("post_attention_layernorm.weight"), _POST_ATTENTION_NORM),
    Param("post_ffn_norm", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,),
          _hf("post_feedforward_layernorm.weight"), _gguf("post_ffw_norm.weight"), when=lambda a: variant(a).post_norms_only),
    Param("gate", LAYER, MATRIX, ("mlp", "embed"), lambda a: (a.intermediate_size, a.hidden_size),
          _phi3("mlp.gate_proj.weight", Chunk(_GATE_UP, 0, 2, 0)),
          _phi3_gguf("ffn_gate.weight", Chunk(_GGUF_GATE_UP, 0, 2, 0)),
          when=_if("dense_mlp"), in_layer=_dense_layer, native=always),
    Param("up", LAYER, MATRIX, ("mlp", "embed"), lambda a: (a.intermediate_size, a.hidden_size),
          _phi3("mlp.up_proj.weight", Chunk(_GATE_UP, 1, 2, 0)),
          _phi3_gguf("ffn_up.weight", Chunk(_GGUF_GATE_UP, 1, 2, 0)),
          when=_if("dense_mlp"), in_layer=_dense_layer, native=always),
    Param("down", LAYER, MATRIX, ("embed", "mlp"), lambda a: (a.hidden_size, a.intermediate_size),
          _hf("mlp.down_proj.weight"), _gguf("ffn_down.weight"), when=_if("dense_mlp"), in_layer=_dense_layer,
          native=always),
    # The MoE MLP (GGUF: GLM-4-MoE's, the experts stacked).  The experts never use the native matmul:
    # their weights are sliced per expert.
    Param("router", LAYER, MATRIX, ("expert_logits", "embed"), lambda a: (a.num_experts, a.hidden_size),
          _moe_hf("gate.weight", "gate.weight"), _gguf("ffn_gate_inp.weight"), when=_if("is_moe"),
          in_layer=_moe_layer),
    # GLM-4-MoE: the bias added to the sigmoid scores to choose experts, and the shared experts.
    Param("router_bias", LAYER, VECTOR, ("expert_logits",), lambda a: (a.num_experts,),
          _hf("mlp.gate.e_score_correction_bias"), _gguf("exp_probs_b.bias"), when=lambda a: a.is_moe and a.moe.router_scoring == "sigmoid",
          in_layer=_moe_layer),
    Param("shared_gate", LAYER, MATRIX, ("moe_mlp", "embed"),
          lambda a: (a.moe.shared_experts * a.moe_intermediate_size, a.hidden_size),
          _hf("mlp.shared_experts.gate_proj.weight"), _gguf("ffn_gate_shexp.weight"), when=lambda a: a.moe.shared_experts > 0, in_layer=_moe_layer,
          native=always),
    Param("shared_up", LAYER, MATRIX, ("moe_mlp", "embed"),
          lambda a: (a.moe.shared_experts * a.moe_intermediate_size, a.hidden_size),
          _hf("mlp.shared_experts.up_proj.weight"), _gguf("ffn_up_shexp.weight"), when=lambda a: a.moe.shared_experts > 0, in_layer=_moe_layer,
          native=always),
    Param("shared_down", LAYER, MATRIX, ("embed", "moe_mlp"),
          lambda a: (a.hidden_size, a.moe.shared_experts * a.moe_intermediate_size),
          _hf("mlp.shared_experts.down_proj.weight"), _gguf("ffn_down_shexp.weight"), when=lambda a: a.moe.shared_experts > 0, in_layer=_moe_layer,
          native=always),
    Param("experts_gate", LAYER, MATRIX, ("expert", "moe_mlp", "embed"),
          lambda a: (a.num_experts, a.moe_intermediate_size, a.hidden_size),
          _moe_hf("experts.{expert}.gate_proj.weight", "experts.{expert}.w1.weight", Chunk(_FUSED_GATE_UP, 0, 2, 1)),
          _gguf("ffn_gate_exps.weight"), when=_if("is_moe"), in_layer=_moe_layer),
    Param("experts_up", LAYER, MATRIX, ("expert", "moe_mlp", "embed"),
          lambda a: (a.num_experts, a.moe_intermediate_size, a.hidden_size),
          _moe_hf("experts.{expert}.up_proj.weight", "experts.{expert}.w3.weight", Chunk(_FUSED_GATE_UP, 1, 2, 1)),
          _gguf("ffn_up_exps.weight"), when=_if("is_moe"), in_layer=_moe_layer),
    Param("experts_down", LAYER, MATRIX, ("expert", "embed", "moe_mlp"),
          lambda a: (a.num_experts, a.hidden_size, a.moe_intermediate_size),
          _moe_hf("experts.{expert}.down_proj.weight", "experts.{expert}.w2.weight", _hf("mlp.experts.down_proj")),
          _gguf("ffn_down_exps.weight"), when=_if("is_moe"), in_layer=_moe_layer),
    # OLMo 2/3: one norm over the whole q (k) projection.
    Param("q_norm_full", LAYER, VECTOR, ("q_heads",), lambda a: (a.q_size,),
          _hf("self_attn.q_norm.weight"), _gguf("attn_q_norm.weight"), when=lambda a: variant(a).qk_norm_whole),
    Param("k_norm_full", LAYER, VECTOR, ("kv_heads",), lambda a: (a.kv_size,),
          _hf("self_attn.k_norm.weight"), _gguf("attn_k_norm.weight"), when=lambda a: variant(a).qk_norm_whole),
), fused=(
    # For the native CPU matmul (runner/weights.py), which only runs unsharded: no sharding
    # rule maps these axes, so they stay replicated.
    Fused("qkv", ("q", "k", "v"), ("fused_qkv", "embed")),
    Fused("qkv_bias", ("q_bias", "k_bias", "v_bias"), ("fused_qkv",)),
    Fused("gate_up", ("gate", "up"), ("fused_mlp", "embed")),
))
"""The Llama family's parameters.  Per-expert tensors (``{expert}``) are stacked into the
``[E, ...]`` parameter; the fused 3-D ones give the whole stack (``gate_up_proj``: two of them)."""

EXPERT_PARAMS = tuple(p.name for p in PARAMS.params if p.axes[0] == "expert")

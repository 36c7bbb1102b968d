"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral) as a pure function.

The architectures differ only in flags of ``ArchConfig``: q/k/v (and o) biases,
per-head q/k RMSNorm, tied embeddings, rope scaling, sliding window, and a sparse
mixture-of-experts MLP (``num_experts > 0``, ``layers/moe.py``) in place of the dense one.
Every weight is declared once, in :data:`PARAMS` (``models/params.py``): loading,
sharding and the device layout are derived from it.  Weights keep transformers' ``[out,
in]`` layout.  ``params["layers"]`` is either a dict of arrays stacked over layers (run
under ``lax.scan``: compile time independent of depth) or a list of per-layer dicts
(unrolled: on XLA:CPU a scanned layer's weights are copied out of the stack before every
matmul).  The KV cache has the matching layout (see
``layers/attention.py``).  Under ``lax.scan`` the expert stacks ``[L, E, ...]`` are not
scanned over but passed whole, so that a layer reads only its routed experts (a scanned
``[E, F, D]`` slice would be copied in full every layer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.layers.attention import AttentionMetadata, KVCache, attend
from jaxllm.layers.linear import embed, linear, matmul
from jaxllm.layers.moe import Routing, moe_mlp
from jaxllm.layers.norm import rms_norm
from jaxllm.layers.rotary import apply_rope, cos_sin, longrope_cos_sin
from jaxllm.models.config import ArchConfig
from jaxllm.models.kernels import Kernels
from jaxllm.models.params import GLOBAL, LAYER, MATRIX, VECTOR, Chunk, Fused, Param, ParamTable, always

Params = dict


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
          _hf("input_layernorm.weight"), _gguf("attn_norm.weight"), when=_if("post_norms_only", False)),
    Param("q", LAYER, MATRIX, ("q_heads", "embed"), lambda a: (a.q_size, a.hidden_size),
          _phi3("self_attn.q_proj.weight", Chunk(_QKV, 0, 3, 0, _qkv_sizes)),
          _phi3_gguf("attn_q.weight", Chunk(_GGUF_QKV, 0, 3, 0, _qkv_sizes)),
          native=always, rope_heads=lambda a: a.num_heads),
    Param("k", LAYER, MATRIX, ("kv_heads", "embed"), lambda a: (a.kv_size, a.hidden_size),
          _phi3("self_attn.k_proj.weight", Chunk(_QKV, 1, 3, 0, _qkv_sizes)),
          _phi3_gguf("attn_k.weight", Chunk(_GGUF_QKV, 1, 3, 0, _qkv_sizes)),
          native=always, rope_heads=lambda a: a.num_kv_heads),
    Param("v", LAYER, MATRIX, ("kv_heads", "embed"), lambda a: (a.kv_size, a.hidden_size),
          _phi3("self_attn.v_proj.weight", Chunk(_QKV, 2, 3, 0, _qkv_sizes)),
          _phi3_gguf("attn_v.weight", Chunk(_GGUF_QKV, 2, 3, 0, _qkv_sizes)),
          native=always),
    Param("o", LAYER, MATRIX, ("embed", "q_heads"), lambda a: (a.hidden_size, a.q_size),
          _hf("self_attn.o_proj.weight"), _gguf("attn_output.weight"), native=always),
    # Before the MLP; with ``post_norms_only`` (OLMo 2/3), on the attention's output instead.
    Param("post_norm", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,),
          _hf("post_attention_layernorm.weight"), _POST_ATTENTION_NORM),
    Param("post_ffn_norm", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,),
          _hf("post_feedforward_layernorm.weight"), _gguf("post_ffw_norm.weight"), when=_if("post_norms_only")),
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
          _hf("mlp.gate.e_score_correction_bias"), _gguf("exp_probs_b.bias"), when=lambda a: a.is_moe and a.router_scoring == "sigmoid",
          in_layer=_moe_layer),
    Param("shared_gate", LAYER, MATRIX, ("moe_mlp", "embed"),
          lambda a: (a.shared_experts * a.moe_intermediate_size, a.hidden_size),
          _hf("mlp.shared_experts.gate_proj.weight"), _gguf("ffn_gate_shexp.weight"), when=lambda a: a.shared_experts > 0, in_layer=_moe_layer,
          native=always),
    Param("shared_up", LAYER, MATRIX, ("moe_mlp", "embed"),
          lambda a: (a.shared_experts * a.moe_intermediate_size, a.hidden_size),
          _hf("mlp.shared_experts.up_proj.weight"), _gguf("ffn_up_shexp.weight"), when=lambda a: a.shared_experts > 0, in_layer=_moe_layer,
          native=always),
    Param("shared_down", LAYER, MATRIX, ("embed", "moe_mlp"),
          lambda a: (a.hidden_size, a.shared_experts * a.moe_intermediate_size),
          _hf("mlp.shared_experts.down_proj.weight"), _gguf("ffn_down_shexp.weight"), when=lambda a: a.shared_experts > 0, in_layer=_moe_layer,
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
    Param("q_bias", LAYER, VECTOR, ("q_heads",), lambda a: (a.q_size,),
          _hf("self_attn.q_proj.bias"), _gguf("attn_q.bias"), when=_if("qkv_bias"), rope_heads=lambda a: a.num_heads),
    Param("k_bias", LAYER, VECTOR, ("kv_heads",), lambda a: (a.kv_size,),
          _hf("self_attn.k_proj.bias"), _gguf("attn_k.bias"), when=_if("qkv_bias"),
          rope_heads=lambda a: a.num_kv_heads),
    Param("v_bias", LAYER, VECTOR, ("kv_heads",), lambda a: (a.kv_size,),
          _hf("self_attn.v_proj.bias"), _gguf("attn_v.bias"), when=_if("qkv_bias")),
    Param("o_bias", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,),
          _hf("self_attn.o_proj.bias"), _gguf("attn_output.bias"), when=_if("o_bias")),
    Param("q_norm", LAYER, VECTOR, ("head_dim",), lambda a: (a.head_dim,),
          _hf("self_attn.q_norm.weight"), _gguf("attn_q_norm.weight"), when=lambda a: a.qk_norm and not a.qk_norm_whole),
    Param("k_norm", LAYER, VECTOR, ("head_dim",), lambda a: (a.head_dim,),
          _hf("self_attn.k_norm.weight"), _gguf("attn_k_norm.weight"), when=lambda a: a.qk_norm and not a.qk_norm_whole),
    # OLMo 2/3: one norm over the whole q (k) projection.
    Param("q_norm_full", LAYER, VECTOR, ("q_heads",), lambda a: (a.q_size,),
          _hf("self_attn.q_norm.weight"), _gguf("attn_q_norm.weight"), when=_if("qk_norm_whole")),
    Param("k_norm_full", LAYER, VECTOR, ("kv_heads",), lambda a: (a.kv_size,),
          _hf("self_attn.k_norm.weight"), _gguf("attn_k_norm.weight"), when=_if("qk_norm_whole")),
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


def _mlp(cfg: ArchConfig, h, lp, layer, md: AttentionMetadata, kernels: Kernels, experts):
    # h [T, D] -> [T, D]: the layer's dense SwiGLU or its MoE block (with shared experts)
    mm = kernels.linear
    if "router" in lp:
        # The experts never use the native matmul: their weights are sliced per expert.  Tokens
        # past query_start_loc[-1] are bucket padding: routed nowhere.
        w = experts if experts is not None else lp
        y = moe_mlp(h, lp["router"], w["experts_gate"], w["experts_up"], w["experts_down"],
                    cfg.num_experts_per_tok, cfg.norm_topk_prob, kernels.moe,
                    layer=layer if experts is not None else None, num_tokens=md.query_start_loc[-1],
                    routing=Routing.of(cfg), bias=lp.get("router_bias"))
        if "shared_gate" in lp:
            shared = jax.nn.silu(linear(h, lp["shared_gate"], backend=mm)) * linear(h, lp["shared_up"], backend=mm)
            y = y + linear(shared, lp["shared_down"], backend=mm)
        return y
    if "gate_up" in lp:
        gate, up = jnp.split(linear(h, lp["gate_up"], backend=mm), 2, axis=-1)   # [T, F] each
        return linear(jax.nn.silu(gate) * up, lp["down"], backend=mm)
    return linear(jax.nn.silu(linear(h, lp["gate"], backend=mm)) * linear(h, lp["up"], backend=mm),
                  lp["down"], backend=mm)


def _residual(cfg: ArchConfig, x, y):
    # Granite scales each block's output; the others add it as it is.
    return x + (y * cfg.residual_multiplier if cfg.residual_multiplier != 1.0 else y)


def _layer(cfg: ArchConfig, x, lp, kv: KVCache, layer, md: AttentionMetadata, cos, sin, kernels: Kernels,
           experts=None, index=None):
    # x [T, D]; experts: the stacked expert weights (scan, with ``layer`` the index) or None
    # (the layer's own are in ``lp``); index: the layer's number (an int unrolled, traced under scan)
    T = x.shape[0]
    mm = kernels.linear
    # the native CPU path's norms: rows summed in one order whatever the step shape (cpu/norm.cc)
    nat = kernels.matmul == "native"
    h = x if cfg.post_norms_only else rms_norm(x, lp["input_norm"], cfg.rms_norm_eps, nat)
    if "qkv" in lp:   # fused projections (runner/weights.fused_parts)
        qkv = linear(h, lp["qkv"], lp.get("qkv_bias"), mm)              # [T, q_size + 2 * kv_size]
        q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
    else:
        q = linear(h, lp["q"], lp.get("q_bias"), mm)
        k = linear(h, lp["k"], lp.get("k_bias"), mm)
        v = linear(h, lp["v"], lp.get("v_bias"), mm)
    if cfg.qk_norm and cfg.qk_norm_whole:                                # OLMo 2/3: over [T, q_size]
        q = rms_norm(q, lp["q_norm_full"], cfg.rms_norm_eps, nat)
        k = rms_norm(k, lp["k_norm_full"], cfg.rms_norm_eps, nat)
    q = q.reshape(T, cfg.num_heads, cfg.head_dim)
    k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm and not cfg.qk_norm_whole:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps, nat)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps, nat)
    if not cfg.no_rope_layers:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    elif isinstance(index, int):
        if index not in cfg.no_rope_layers:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    else:   # scanned: the layer's NoPE flag is data
        nope = jnp.asarray([i in cfg.no_rope_layers for i in range(cfg.num_layers)])[index]
        q = jnp.where(nope, q, apply_rope(q, cos, sin))
        k = jnp.where(nope, k, apply_rope(k, cos, sin))
    scale = cfg.head_dim ** -0.5 if cfg.attention_multiplier is None else cfg.attention_multiplier
    # a layer's own window (OLMo 3's layer_types; mixed layers run unrolled, so index is an int)
    window = cfg.window(index) if isinstance(index, int) else cfg.sliding_window
    o, kv = attend(q, k, v, kv, layer, md, scale=scale, sliding_window=window,
                   backend=kernels.attention)                           # [T, Hq, Dh]
    o = linear(o.reshape(T, cfg.q_size), lp["o"], lp.get("o_bias"), mm)
    if cfg.post_norms_only:
        o = rms_norm(o, lp["post_norm"], cfg.rms_norm_eps, nat)
    x = _residual(cfg, x, o)
    h = x if cfg.post_norms_only else rms_norm(x, lp["post_norm"], cfg.rms_norm_eps, nat)
    y = _mlp(cfg, h, lp, layer, md, kernels, experts)
    if cfg.post_norms_only:
        y = rms_norm(y, lp["post_ffn_norm"], cfg.rms_norm_eps, nat)
    return _residual(cfg, x, y), kv


def _rotary(cfg: ArchConfig, params: Params, md: AttentionMetadata):
    """cos, sin [T, R/2] of this step's tokens."""
    if cfg.longrope:
        # transformers picks the long factors for a whole forward once its sequence is longer
        # than the original context (max position + 1 > original_max_position_embeddings);
        # here each sequence of the batch by its own length after this step.
        long = md.seq_lens[md.token_seq] > cfg.rope_scaling.original_max_position_embeddings   # [T]
        return longrope_cos_sin(md.positions, params["rope_inv_freq"], long, cfg.rope_scaling.attention_factor)
    return cos_sin(md.positions, params["rope_inv_freq"])


def forward(cfg: ArchConfig, params: Params, kv: KVCache, input_ids: jax.Array, md: AttentionMetadata,
            kernels: Kernels = Kernels()) -> tuple[jax.Array, KVCache]:
    """input_ids [T] -> final hidden states [T, D] and the updated cache, with the
    operations' implementations ``kernels`` (``params`` laid out for them: runner/weights.py)."""
    native = kernels.matmul == "native"
    # The tied embedding is laid out as the native LM head (runner/weights.host_params).
    x = embed(params["embed"], input_ids, panels=native and cfg.tie_word_embeddings)   # [T, D]
    if native:
        # On CPU activations stay float32 whatever the weight dtype: bf16 and quantized
        # weights then cost fewer bytes without low-precision arithmetic anywhere.
        x = x.astype(jnp.float32)
    if cfg.embedding_multiplier != 1.0:
        x = x * cfg.embedding_multiplier
    cos, sin = _rotary(cfg, params, md)                                  # [T, R/2]
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        ks, vs = list(kv[0]), list(kv[1])
        for i, lp in enumerate(layers):
            x, (ks[i], vs[i]) = _layer(cfg, x, lp, (ks[i], vs[i]), None, md, cos, sin, kernels, index=i)
        kv = (ks, vs)
    else:
        if len(set(cfg.layer_types)) > 1:
            # one scanned body has one static window (engine/resolve.py unrolls these)
            raise ValueError(f"{cfg.architecture}'s layers mix sliding and full attention: they run unrolled, "
                             "not stacked under lax.scan")
        experts = {n: layers[n] for n in EXPERT_PARAMS if n in layers} or None
        scanned = {n: a for n, a in layers.items() if n not in EXPERT_PARAMS}

        def body(carry, xs):
            x, kv = carry
            lp, i = xs
            x, kv = _layer(cfg, x, lp, kv, i, md, cos, sin, kernels, experts, index=i)
            return (x, kv), None
        (x, kv), _ = jax.lax.scan(body, (x, kv), (scanned, jnp.arange(cfg.num_layers, dtype=jnp.int32)))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps, native), kv


def compute_logits(cfg: ArchConfig, params: Params, hidden: jax.Array, kernels: Kernels = Kernels()) -> jax.Array:
    """hidden [S, D] -> float32 logits [S, V]."""
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    logits = matmul(hidden, w, kernels.linear)
    return logits / cfg.logits_scaling if cfg.logits_scaling != 1.0 else logits   # Granite divides

"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral) as a pure function.

The architectures differ only in flags of ``ArchConfig``: q/k/v (and o) biases,
per-head q/k RMSNorm, tied embeddings, rope scaling, sliding window, and a sparse
mixture-of-experts MLP (``num_experts > 0``, ``layers/moe.py``) in place of the dense one.
Every weight is declared once, in :data:`PARAMS` (``models/llama/params.py``): loading,
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
from jaxllm.lora import apply as lora_apply
from jaxllm.lora.apply import LoRAStep
from jaxllm.models.config import ArchConfig
from jaxllm.models.kernels import Kernels
from jaxllm.models.llama.config import variant
from jaxllm.models.llama.params import EXPERT_PARAMS

Params = dict


def _mlp(cfg: ArchConfig, h, lp, layer, md: AttentionMetadata, kernels: Kernels, experts,
         lora: LoRAStep | None = None, index=None):
    # h [T, D] -> [T, D]: the layer's dense SwiGLU or its MoE block (with shared experts);
    # lora: the step's adapters, added to the dense projections at layer ``index``
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
        gate_up = lora_apply.add_fused(linear(h, lp["gate_up"], backend=mm), lora, ("gate", "up"), h, index)
        gate, up = jnp.split(gate_up, 2, axis=-1)                        # [T, F] each
    else:
        gate, up = lora_apply.add_each((linear(h, lp["gate"], backend=mm), linear(h, lp["up"], backend=mm)),
                                       lora, ("gate", "up"), h, index)
    a = jax.nn.silu(gate) * up
    return lora_apply.add(linear(a, lp["down"], backend=mm), lora, "down", a, index)


def _residual(cfg: ArchConfig, x, y):
    # Granite scales each block's output; the others add it as it is.
    var = variant(cfg)
    return x + (y * var.residual_multiplier if var.residual_multiplier != 1.0 else y)


def _layer(cfg: ArchConfig, x, lp, kv: KVCache, layer, md: AttentionMetadata, cos, sin, kernels: Kernels,
           experts=None, index=None, lora: LoRAStep | None = None):
    # x [T, D]; experts: the stacked expert weights (scan, with ``layer`` the index) or None
    # (the layer's own are in ``lp``); index: the layer's number (an int unrolled, traced under scan);
    # lora: the step's adapters (lora/apply.py), or None
    T = x.shape[0]
    var = variant(cfg)
    mm = kernels.linear
    # the native CPU path's norms: rows summed in one order whatever the step shape (cpu/norm.cc)
    nat = kernels.matmul == "native"
    h = x if var.post_norms_only else rms_norm(x, lp["input_norm"], cfg.rms_norm_eps, nat)
    if "qkv" in lp:   # fused projections (runner/weights.fused_parts)
        qkv = linear(h, lp["qkv"], lp.get("qkv_bias"), mm)              # [T, q_size + 2 * kv_size]
        qkv = lora_apply.add_fused(qkv, lora, ("q", "k", "v"), h, index)
        q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
    else:
        q, k, v = lora_apply.add_each(tuple(linear(h, lp[n], lp.get(n + "_bias"), mm) for n in ("q", "k", "v")),
                                      lora, ("q", "k", "v"), h, index)
    if cfg.qk_norm and var.qk_norm_whole:                                # OLMo 2/3: over [T, q_size]
        q = rms_norm(q, lp["q_norm_full"], cfg.rms_norm_eps, nat)
        k = rms_norm(k, lp["k_norm_full"], cfg.rms_norm_eps, nat)
    q = q.reshape(T, cfg.num_heads, cfg.head_dim)
    k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm and not var.qk_norm_whole:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps, nat)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps, nat)
    if not var.no_rope_layers:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    elif isinstance(index, int):
        if index not in var.no_rope_layers:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    else:   # scanned: the layer's NoPE flag is data
        nope = jnp.asarray([i in var.no_rope_layers for i in range(cfg.num_layers)])[index]
        q = jnp.where(nope, q, apply_rope(q, cos, sin))
        k = jnp.where(nope, k, apply_rope(k, cos, sin))
    scale = cfg.head_dim ** -0.5 if var.attention_multiplier is None else var.attention_multiplier
    # a layer's own window (OLMo 3's layer_types; mixed layers run unrolled, so index is an int)
    window = cfg.window(index) if isinstance(index, int) else cfg.sliding_window
    o, kv = attend(q, k, v, kv, layer, md, scale=scale, sliding_window=window,
                   backend=kernels.attention)                           # [T, Hq, Dh]
    o = o.reshape(T, cfg.q_size)
    o = lora_apply.add(linear(o, lp["o"], lp.get("o_bias"), mm), lora, "o", o, index)
    if var.post_norms_only:
        o = rms_norm(o, lp["post_norm"], cfg.rms_norm_eps, nat)
    x = _residual(cfg, x, o)
    h = x if var.post_norms_only else rms_norm(x, lp["post_norm"], cfg.rms_norm_eps, nat)
    y = _mlp(cfg, h, lp, layer, md, kernels, experts, lora, index)
    if var.post_norms_only:
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
            kernels: Kernels = Kernels(), lora: LoRAStep | None = None) -> tuple[jax.Array, KVCache]:
    """input_ids [T] -> final hidden states [T, D] and the updated cache, with the
    operations' implementations ``kernels`` (``params`` laid out for them: runner/weights.py);
    ``lora``: the step's LoRA adapters and each token's slot (None: the base model only)."""
    native = kernels.matmul == "native"
    # The tied embedding is laid out as the native LM head (runner/weights.host_params).
    x = embed(params["embed"], input_ids, panels=native and cfg.tie_word_embeddings)   # [T, D]
    if native:
        # On CPU activations stay float32 whatever the weight dtype: bf16 and quantized
        # weights then cost fewer bytes without low-precision arithmetic anywhere.
        x = x.astype(jnp.float32)
    var = variant(cfg)
    if var.embedding_multiplier != 1.0:
        x = x * var.embedding_multiplier
    cos, sin = _rotary(cfg, params, md)                                  # [T, R/2]
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        ks, vs = list(kv[0]), list(kv[1])
        for i, lp in enumerate(layers):
            x, (ks[i], vs[i]) = _layer(cfg, x, lp, (ks[i], vs[i]), None, md, cos, sin, kernels, index=i, lora=lora)
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
            x, kv = _layer(cfg, x, lp, kv, i, md, cos, sin, kernels, experts, index=i, lora=lora)
            return (x, kv), None
        (x, kv), _ = jax.lax.scan(body, (x, kv), (scanned, jnp.arange(cfg.num_layers, dtype=jnp.int32)))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps, native), kv


def compute_logits(cfg: ArchConfig, params: Params, hidden: jax.Array, kernels: Kernels = Kernels()) -> jax.Array:
    """hidden [S, D] -> float32 logits [S, V]."""
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    logits = matmul(hidden, w, kernels.linear)
    var = variant(cfg)
    return logits / var.logits_scaling if var.logits_scaling != 1.0 else logits   # Granite divides

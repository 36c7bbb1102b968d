"""GPT-OSS (``GptOssForCausalLM``) as a pure function, following transformers' ``modeling_gpt_oss``.

A pre-norm decoder like Llama's (``models/llama/``), with:

* attention sinks: one learned logit per query head that joins the softmax's denominator
  (``self_attn.sinks``, ``layers/attention.py``), biases on q/k/v/o;
* sliding-window and full layers alternating (``layer_types``), so the model runs unrolled;
* YaRN RoPE: interpolated frequencies and cos/sin scaled by its attention factor;
* a mixture of experts in every layer: router logits with a bias, the top-k logits
  softmaxed, and experts with biases and the clamped SwiGLU
  ``(clip(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)``, where gate
  and up are the even and odd columns of one fused projection.

The experts keep the checkpoint's layout (``gate_up_proj [E, D, 2F]``, ``down_proj [E, F, D]``:
input features first, unlike the ``[out, in]`` of every other weight here) and run through the
grouped experts of ``layers/moe.py``: a layer reads only its routed experts.  MXFP4
checkpoints (the released gpt-oss weights' ``*_blocks`` / ``*_scales``) are refused by the
loader; their bf16 conversions load.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.formats.storage import PACKED_BF16
from jaxllm.layers.attention import AttentionMetadata, KVCache, attend
from jaxllm.layers.linear import embed, linear, matmul
from jaxllm.layers.moe import routed_experts
from jaxllm.layers.norm import rms_norm
from jaxllm.layers.rotary import apply_rope, cos_sin
from jaxllm.models.config import ArchConfig
from jaxllm.models.kernels import Kernels
from jaxllm.models.gpt_oss.params import EXPERT_PARAMS


# ----------------------------------------------------------------------------- model

def _dot_in_out(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [B, in] @ w [in, out] -> float32 [B, out] (w float, or bf16 bits on CPU)."""
    if w.dtype == PACKED_BF16:
        w = jax.lax.bitcast_convert_type(w, jnp.bfloat16)
    return jax.lax.dot_general(x.astype(w.dtype), w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _expert_fn(alpha: float, limit: float):
    def expert(x, gate_up, gate_up_bias, down, down_bias):
        # x [B, D]; gate_up [D, 2F], gate_up_bias [2F]; down [F, D], down_bias [D] -> float32 [B, D]
        h = _dot_in_out(x, gate_up) + gate_up_bias.astype(jnp.float32)     # [B, 2F]
        gate, up = h[:, ::2], h[:, 1::2]                                    # [B, F] each
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        act = (up + 1.0) * (gate * jax.nn.sigmoid(gate * alpha))
        return _dot_in_out(act.astype(x.dtype), down) + down_bias.astype(jnp.float32)
    return expert


def route(x: jax.Array, router: jax.Array, bias: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """x [T, D] -> (weights [T, k] float32, experts [T, k] int32): the top-k of the biased
    router logits, softmaxed among themselves (transformers' ``GptOssTopKRouter``)."""
    logits = matmul(x, router) + bias.astype(jnp.float32)              # [T, E]
    top, experts = jax.lax.top_k(logits, top_k)                       # [T, k]
    return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)


def _layer(cfg: ArchConfig, i: int, x, lp, kv: KVCache, layer, md: AttentionMetadata, cos, sin, kernels: Kernels,
           experts=None):
    # x [T, D]; i: the static layer number (its window); layer: the cache / expert-stack index (scan) or None
    T = x.shape[0]
    mm = kernels.linear
    nat = kernels.matmul == "native"   # cpu/norm.cc: rows summed in one order whatever the step shape
    h = rms_norm(x, lp["input_norm"], cfg.rms_norm_eps, nat)
    if "qkv" in lp:
        q, k, v = jnp.split(linear(h, lp["qkv"], lp.get("qkv_bias"), mm), [cfg.q_size, cfg.q_size + cfg.kv_size],
                            axis=-1)
    else:
        q, k, v = (linear(h, lp[n], lp.get(n + "_bias"), mm) for n in ("q", "k", "v"))
    q = q.reshape(T, cfg.num_heads, cfg.head_dim)                       # [T, Hq, Dh]
    k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)                    # [T, Hkv, Dh]
    v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o, kv = attend(q, k, v, kv, layer, md, scale=cfg.head_dim ** -0.5, sliding_window=cfg.window(i),
                   sinks=lp["sinks"], backend=kernels.attention)        # [T, Hq, Dh]
    x = x + linear(o.reshape(T, cfg.q_size), lp["o"], lp.get("o_bias"), mm)
    h = rms_norm(x, lp["post_norm"], cfg.rms_norm_eps, nat)
    weights, chosen = route(h, lp["router"], lp["router_bias"], cfg.num_experts_per_tok)   # [T, k]
    w = experts if experts is not None else lp
    # Tokens past query_start_loc[-1] are bucket padding: routed nowhere.
    impl = "expert_parallel" if kernels.moe == "expert_parallel" else "grouped"
    y = routed_experts(h, weights, chosen, tuple(w[n] for n in EXPERT_PARAMS), impl,
                       _expert_fn(cfg.gpt_oss.swiglu_alpha, cfg.gpt_oss.swiglu_limit),
                       layer=layer if experts is not None else None, num_tokens=md.query_start_loc[-1])
    return x + y.astype(x.dtype), kv


def forward(cfg: ArchConfig, params: dict, kv: KVCache, input_ids: jax.Array, md: AttentionMetadata,
            kernels: Kernels = Kernels()) -> tuple[jax.Array, KVCache]:
    """input_ids [T] -> final hidden states [T, D] and the updated cache."""
    native = kernels.matmul == "native"
    x = embed(params["embed"], input_ids, panels=native and cfg.tie_word_embeddings)   # [T, D]
    if native:
        x = x.astype(jnp.float32)
    cos, sin = cos_sin(md.positions, params["rope_inv_freq"])           # [T, Dh/2]
    if cfg.rope_scaling.attention_factor != 1.0:                        # YaRN scales cos and sin
        cos, sin = cos * cfg.rope_scaling.attention_factor, sin * cfg.rope_scaling.attention_factor
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        ks, vs = list(kv[0]), list(kv[1])
        for i, lp in enumerate(layers):
            x, (ks[i], vs[i]) = _layer(cfg, i, x, lp, (ks[i], vs[i]), None, md, cos, sin, kernels)
        kv = (ks, vs)
    else:
        if not cfg.uniform_layers:
            raise ValueError(f"{cfg.architecture}: layers with different windows cannot run under lax.scan")
        experts = {n: layers[n] for n in EXPERT_PARAMS}
        scanned = {n: a for n, a in layers.items() if n not in EXPERT_PARAMS}

        def body(carry, xs):
            x, kv = carry
            lp, li = xs
            x, kv = _layer(cfg, 0, x, lp, kv, li, md, cos, sin, kernels, experts)
            return (x, kv), None
        (x, kv), _ = jax.lax.scan(body, (x, kv), (scanned, jnp.arange(cfg.num_layers, dtype=jnp.int32)))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps, kernels.matmul == "native"), kv


def compute_logits(cfg: ArchConfig, params: dict, hidden: jax.Array, kernels: Kernels = Kernels()) -> jax.Array:
    """hidden [S, D] -> float32 logits [S, V]."""
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return matmul(hidden, w, kernels.linear)

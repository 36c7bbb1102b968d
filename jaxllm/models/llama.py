"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral) as a pure function.

The architectures differ only in flags of ``ArchConfig``: q/k/v (and o) biases,
per-head q/k RMSNorm, tied embeddings, rope scaling, sliding window, and a sparse
mixture-of-experts MLP (``num_experts > 0``, ``layers/moe.py``) in place of the dense one.
Weights keep transformers' ``[out, in]`` layout.  ``params["layers"]`` is either a dict of arrays
stacked over layers (run under ``lax.scan``: compile time independent of depth) or a list
of per-layer dicts (unrolled: on XLA:CPU a scanned layer's weights are copied out of the
stack before every matmul).  The KV cache has the matching layout (see
``layers/attention.py``).  Under ``lax.scan`` the expert stacks ``[L, E, ...]`` are not
scanned over but passed whole, so that a layer reads only its routed experts (a scanned
``[E, F, D]`` slice would be copied in full every layer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.cpu import layout
from jaxllm.layers import storage
from jaxllm.layers.attention import AttentionMetadata, KVCache, attend
from jaxllm.layers.linear import linear, matmul
from jaxllm.layers.moe import moe_mlp
from jaxllm.layers.norm import rms_norm
from jaxllm.layers.rotary import apply_rope, cos_sin
from jaxllm.models.config import ArchConfig

Params = dict

EXPERT_PARAMS = ("experts_gate", "experts_up", "experts_down")

MOE_IMPL = "grouped"
"""Default expert implementation (``layers/moe.py``): "grouped" (only routed experts) or
"dense" (every expert, the benchmark's baseline); ``forward(moe_impl=...)`` overrides it."""


def layer_param_shapes(cfg: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's weights, by our internal name."""
    D, F, Dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {
        "input_norm": (D,), "q": (cfg.q_size, D), "k": (cfg.kv_size, D), "v": (cfg.kv_size, D),
        "o": (D, cfg.q_size), "post_norm": (D,),
    }
    if cfg.is_moe:
        E, Fe = cfg.num_experts, cfg.moe_intermediate_size
        shapes.update(router=(E, D), experts_gate=(E, Fe, D), experts_up=(E, Fe, D), experts_down=(E, D, Fe))
    else:
        shapes.update(gate=(F, D), up=(F, D), down=(D, F))
    if cfg.qkv_bias:
        shapes.update(q_bias=(cfg.q_size,), k_bias=(cfg.kv_size,), v_bias=(cfg.kv_size,))
    if cfg.o_bias:
        shapes["o_bias"] = (D,)
    if cfg.qk_norm:
        shapes.update(q_norm=(Dh,), k_norm=(Dh,))
    return shapes


def global_param_shapes(cfg: ArchConfig) -> dict[str, tuple[int, ...]]:
    shapes = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def _layer(cfg: ArchConfig, x, lp, kv: KVCache, layer, md: AttentionMetadata, cos, sin, mm: str, attn: str,
           moe_impl: str = MOE_IMPL, experts=None):
    # x [T, D]; experts: the stacked expert weights (scan, with ``layer`` the index) or None
    # (the layer's own are in ``lp``)
    T = x.shape[0]
    h = rms_norm(x, lp["input_norm"], cfg.rms_norm_eps)
    if "qkv" in lp:   # fused projections (runner/weights.fused_parts)
        qkv = linear(h, lp["qkv"], lp.get("qkv_bias"), mm)              # [T, q_size + 2 * kv_size]
        q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
    else:
        q = linear(h, lp["q"], lp.get("q_bias"), mm)
        k = linear(h, lp["k"], lp.get("k_bias"), mm)
        v = linear(h, lp["v"], lp.get("v_bias"), mm)
    q = q.reshape(T, cfg.num_heads, cfg.head_dim)
    k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o, kv = attend(q, k, v, kv, layer, md, scale=cfg.head_dim ** -0.5, sliding_window=cfg.sliding_window,
                   backend=attn)                                        # [T, Hq, Dh]
    x = x + linear(o.reshape(T, cfg.q_size), lp["o"], lp.get("o_bias"), mm)
    h = rms_norm(x, lp["post_norm"], cfg.rms_norm_eps)
    if cfg.is_moe:
        # The experts never use the native matmul: their weights are sliced per expert.  Tokens
        # past query_start_loc[-1] are bucket padding: routed nowhere.
        w = experts if experts is not None else lp
        x = x + moe_mlp(h, lp["router"], w["experts_gate"], w["experts_up"], w["experts_down"],
                        cfg.num_experts_per_tok, cfg.norm_topk_prob, moe_impl,
                        layer=layer if experts is not None else None, num_tokens=md.query_start_loc[-1])
    elif "gate_up" in lp:
        gate, up = jnp.split(linear(h, lp["gate_up"], backend=mm), 2, axis=-1)   # [T, F] each
        x = x + linear(jax.nn.silu(gate) * up, lp["down"], backend=mm)
    else:
        x = x + linear(jax.nn.silu(linear(h, lp["gate"], backend=mm)) * linear(h, lp["up"], backend=mm),
                       lp["down"], backend=mm)
    return x, kv


def forward(cfg: ArchConfig, params: Params, kv: KVCache, input_ids: jax.Array,
            md: AttentionMetadata, matmul_backend: str = "xla",
            attention_backend: str = "xla", moe_impl: str | None = None) -> tuple[jax.Array, KVCache]:
    """input_ids [T] -> final hidden states [T, D] and the updated cache.

    ``matmul_backend``: "xla" (dot_general) or "native" (the CPU kernel in jaxllm/cpu);
    ``attention_backend``: "xla", "pallas" or "native" (see ``layers.attention.attend``);
    ``moe_impl``: "grouped" or "dense" for MoE checkpoints (default ``MOE_IMPL``)."""
    moe_impl = moe_impl or MOE_IMPL
    if matmul_backend == "native" and cfg.tie_word_embeddings:
        # The tied embedding is laid out as the native LM head (runner/weights.host_params).
        x = layout.take_rows(params["embed"], input_ids)                  # [T, D]
    else:
        x = params["embed"][input_ids]                                    # [T, D]
    if x.dtype == storage.PACKED_BF16 or matmul_backend == "native":
        # On CPU activations stay float32 whatever the weight dtype: bf16 weights then
        # cost half the bytes without bf16 arithmetic anywhere.
        x = storage.load(x)
    cos, sin = cos_sin(md.positions, params["rope_inv_freq"])             # [T, Dh/2]
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        ks, vs = list(kv[0]), list(kv[1])
        for i, lp in enumerate(layers):
            x, (ks[i], vs[i]) = _layer(cfg, x, lp, (ks[i], vs[i]), None, md, cos, sin, matmul_backend,
                                        attention_backend, moe_impl)
        kv = (ks, vs)
    else:
        experts = {n: layers[n] for n in EXPERT_PARAMS if n in layers} or None
        scanned = {n: a for n, a in layers.items() if n not in EXPERT_PARAMS}

        def body(carry, xs):
            x, kv = carry
            lp, i = xs
            x, kv = _layer(cfg, x, lp, kv, i, md, cos, sin, matmul_backend, attention_backend, moe_impl, experts)
            return (x, kv), None
        (x, kv), _ = jax.lax.scan(body, (x, kv), (scanned, jnp.arange(cfg.num_layers, dtype=jnp.int32)))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), kv


def compute_logits(cfg: ArchConfig, params: Params, hidden: jax.Array, matmul_backend: str = "xla") -> jax.Array:
    """hidden [S, D] -> float32 logits [S, V]."""
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return matmul(hidden, w, matmul_backend)

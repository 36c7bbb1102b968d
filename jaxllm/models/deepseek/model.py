"""DeepSeek-V2 and DeepSeek-V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``) as a pure
function, following transformers' ``modeling_deepseek_v2`` / ``modeling_deepseek_v3``.

A pre-norm decoder with:

* multi-head latent attention (``layers/mla_attention.py``): the query through a low-rank
  ``q_a_proj`` -> RMSNorm -> ``q_b_proj`` (or one ``q_proj`` when ``q_lora_rank`` is None, as in
  V2-Lite); keys and values from one latent per token (``kv_a_proj_with_mqa`` -> RMSNorm) plus
  one rotary key shared by the heads; each head's q/k split into ``qk_nope_head_dim`` dims
  without rotary and ``qk_rope_head_dim`` with it (decoupled RoPE).  The cache holds the latent
  and the rotary key (:func:`cache_kinds`), never the expanded K/V; attention runs in the
  absorbed form, ``kv_b_proj`` split per head into W_UK (folded into the query) and W_UV
  (applied to the attended latent);
* RoPE on interleaved pairs (V2 always, V3 with ``rope_interleave``), YaRN with the
  checkpoint's ``mscale`` / ``mscale_all_dim``: cos and sin scaled by the attention factor,
  and the softmax scale ``qk_head_dim ** -0.5`` by ``mscale(factor, mscale_all_dim) ** 2``;
* a dense SwiGLU MLP in the first ``first_k_dense_replace`` layers, then routed experts plus
  ``n_shared_experts`` shared ones: V2 routes by softmax (``greedy`` or
  ``group_limited_greedy``, weights not renormalised, times ``routed_scaling_factor``); V3 by
  sigmoid scores with ``e_score_correction_bias``, grouped top-k and renormalised weights
  (``layers/moe.Routing``, shared with GLM-4-MoE).

Options the engine does not implement are refused by name (:func:`arch_config`).  MLA runs
on each attention backend: XLA, the Pallas MLA kernel, the native CPU kernel
(``layers/mla_attention``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.core.kv_budget import CacheKind
from jaxllm.formats import storage
from jaxllm.layers import kv_quant
from jaxllm.layers.attention import AttentionMetadata
from jaxllm.layers.linear import embed, linear, matmul
from jaxllm.layers.mla_attention import MLACache, attend_mla
from jaxllm.layers.moe import Routing, moe_mlp, routed_experts
from jaxllm.layers.norm import rms_norm
from jaxllm.layers.rotary import apply_rope, cos_sin
from jaxllm.models.config import ArchConfig
from jaxllm.models.deepseek.params import EXPERT_PARAMS
from jaxllm.models.kernels import Kernels
from jaxllm.parallel.sharding import LAYERS, cache_array


# ----------------------------------------------------------------------------- the cache

def latent_width(arch: ArchConfig) -> int:
    """Values cached per token and layer: the latent and the rotary key."""
    return arch.mla.kv_lora_rank + arch.head_dim


def cache_kinds(arch: ArchConfig, itemsize: int, kv_cache_dtype: str = "auto") -> tuple[CacheKind, ...]:
    """Every layer caches one latent and one rotary key per token (core/kv_budget.py)."""
    if kv_cache_dtype != "auto":
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} is not supported for {arch.architecture} "
                         "(its MLA latent cache is kept in the model dtype); use --kv-cache-dtype auto")
    return (CacheKind("MLA latent + rope key", arch.num_layers, token_bytes=latent_width(arch) * itemsize),)


def allocate_cache(arch: ArchConfig, num_blocks: int, block_size: int, dtype, stacked: bool, make=jnp.zeros,
                   sharding=None) -> MLACache:
    """Zeroed latent pages (``layers/mla_attention.MLACache``); ``make=jax.ShapeDtypeStruct``
    gives the shapes without allocating.  ``sharding``: logical axes -> the array's sharding
    (parallel/sharding.py); none of the pages' axes splits: one latent per token serves every
    head, so every device keeps all of them."""
    shape = (num_blocks, block_size, latent_width(arch))
    if isinstance(dtype, kv_quant.KVFormat):   # refused earlier by cache_kinds, named by its flag
        raise ValueError(f"{arch.architecture}: a quantized KV cache is not supported for MLA; "  # noqa: TRY004
                         "use --kv-cache-dtype auto")
    axes = ("kv_blocks", "block", "latent")
    if stacked:
        return (cache_array(make, sharding, (arch.num_layers, *shape), dtype, (LAYERS, *axes)),)
    return ([cache_array(make, sharding, shape, dtype, axes) for _ in range(arch.num_layers)],)


# ----------------------------------------------------------------------------- model

def _rope(cfg: ArchConfig, x, cos, sin):
    # x [T, H, Dr]; DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... each rotated by one
    # frequency.  The result is laid out de-interleaved (evens' rotations, then odds'), which
    # changes no dot product: q and k are laid out alike.
    if not cfg.mla.rope_interleave:
        return apply_rope(x, cos, sin)
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _route_v2(cfg: ArchConfig, h, router):
    """DeepSeek-V2's router (transformers' ``DeepseekV2TopkRouter``): softmax over every
    expert, ``group_limited_greedy`` zeroing all but the ``topk_group`` groups of best single
    expert, the top k probabilities (not renormalised) times ``routed_scaling_factor``."""
    probs = jax.nn.softmax(matmul(h, router), axis=-1)             # [T, E] float32
    if cfg.moe.topk_method == "group_limited_greedy" and cfg.moe.n_group > 1:
        T, E = probs.shape
        G = cfg.moe.n_group
        best = jax.lax.top_k(probs.reshape(T, G, E // G).max(axis=-1), cfg.moe.topk_group)[1]   # [T, topk_group]
        keep = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], best].set(True)
        probs = jnp.where(jnp.repeat(keep, E // G, axis=1), probs, 0.0)
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)   # [T, k]
    return weights * jnp.float32(cfg.moe.routed_scaling_factor), experts.astype(jnp.int32)


def _mlp(cfg: ArchConfig, h, lp, layer, md: AttentionMetadata, kernels: Kernels, experts):
    # h [T, D] -> [T, D]: the dense SwiGLU of the first layers, else routed + shared experts
    mm = kernels.linear
    if "router" not in lp:
        return linear(jax.nn.silu(linear(h, lp["gate"], backend=mm)) * linear(h, lp["up"], backend=mm),
                      lp["down"], backend=mm)
    w = experts if experts is not None else lp
    stack_layer = layer if experts is not None else None
    if cfg.moe.router_scoring == "sigmoid":
        y = moe_mlp(h, lp["router"], w["experts_gate"], w["experts_up"], w["experts_down"], cfg.num_experts_per_tok,
                    cfg.norm_topk_prob, kernels.moe, layer=stack_layer, num_tokens=md.query_start_loc[-1],
                    routing=Routing.of(cfg), bias=lp["router_bias"])
    else:
        weights, chosen = _route_v2(cfg, h, lp["router"])
        impl = "expert_parallel" if kernels.moe == "expert_parallel" else "grouped"
        y = routed_experts(h, weights, chosen, tuple(w[n] for n in EXPERT_PARAMS), impl, layer=stack_layer,
                           num_tokens=md.query_start_loc[-1]).astype(h.dtype)
    if "shared_gate" in lp:
        shared = jax.nn.silu(linear(h, lp["shared_gate"], backend=mm)) * linear(h, lp["shared_up"], backend=mm)
        y = y + linear(shared, lp["shared_down"], backend=mm)
    return y


def _attention(cfg: ArchConfig, h, lp, pages, layer, md: AttentionMetadata, cos, sin, kernels: Kernels):
    # h [T, D] -> ([T, D], pages)
    T = h.shape[0]
    mm = kernels.linear
    H, Dn, Dr, Dv, R = cfg.num_heads, cfg.mla.qk_nope_head_dim, cfg.head_dim, cfg.mla.v_head_dim, cfg.mla.kv_lora_rank
    if cfg.mla.q_lora_rank:
        q = linear(rms_norm(linear(h, lp["q_a"], backend=mm), lp["q_a_norm"], cfg.rms_norm_eps), lp["q_b"], backend=mm)
    else:
        q = linear(h, lp["q"], backend=mm)
    q = q.reshape(T, H, Dn + Dr)
    q_nope, q_pe = q[..., :Dn], q[..., Dn:]                          # [T, H, Dn], [T, H, Dr]
    ckv = linear(h, lp["kv_a"], backend=mm)                          # [T, R + Dr]
    latent = rms_norm(ckv[:, :R], lp["kv_a_norm"], cfg.rms_norm_eps)  # [T, R]
    k_pe = ckv[:, R:]                                                # [T, Dr]
    q_pe = _rope(cfg, q_pe, cos, sin)
    k_pe = _rope(cfg, k_pe[:, None, :], cos, sin)[:, 0]
    # kv_b [H * (Dn + Dv), R], head-major: W_UK [H, Dn, R] then W_UV [H, Dv, R] of each head.
    w_kv = storage.load(lp["kv_b"]).reshape(H, Dn + Dv, R)
    q_lat = jnp.einsum("thn,hnr->thr", q_nope.astype(jnp.float32), w_kv[:, :Dn])      # [T, H, R]
    o_lat, pages = attend_mla(q_lat, q_pe, latent, k_pe, pages, layer, md, scale=cfg.attn_scale,
                              backend=kernels.attention)            # [T, H, R]
    o = jnp.einsum("thr,hvr->thv", o_lat, w_kv[:, Dn:]).astype(h.dtype)                # [T, H, Dv]
    return linear(o.reshape(T, H * Dv), lp["o"], backend=mm), pages


def _layer(cfg: ArchConfig, x, lp, pages, layer, md: AttentionMetadata, cos, sin, kernels: Kernels, experts=None):
    # x [T, D]; layer: the cache / expert-stack index under scan, or None
    nat = kernels.matmul == "native"   # cpu/norm.cc: rows summed in one order whatever the step shape
    h = rms_norm(x, lp["input_norm"], cfg.rms_norm_eps, nat)
    o, pages = _attention(cfg, h, lp, pages, layer, md, cos, sin, kernels)
    x = x + o
    h = rms_norm(x, lp["post_norm"], cfg.rms_norm_eps, nat)
    return x + _mlp(cfg, h, lp, layer, md, kernels, experts), pages


def forward(cfg: ArchConfig, params: dict, kv: MLACache, input_ids: jax.Array, md: AttentionMetadata,
            kernels: Kernels = Kernels()) -> tuple[jax.Array, MLACache]:
    """input_ids [T] -> final hidden states [T, D] and the updated latent cache."""
    native = kernels.matmul == "native"
    x = embed(params["embed"], input_ids, panels=native and cfg.tie_word_embeddings)   # [T, D]
    if native:
        x = x.astype(jnp.float32)
    cos, sin = cos_sin(md.positions, params["rope_inv_freq"])       # [T, Dr/2]
    if cfg.rope_scaling.attention_factor != 1.0:                    # YaRN scales cos and sin
        cos, sin = cos * cfg.rope_scaling.attention_factor, sin * cfg.rope_scaling.attention_factor
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        pages = list(kv[0])
        for i, lp in enumerate(layers):
            x, pages[i] = _layer(cfg, x, lp, pages[i], None, md, cos, sin, kernels)
        kv = (pages,)
    else:
        if not cfg.uniform_layers:
            raise ValueError(f"{cfg.architecture}: dense first layers and MoE layers cannot run under lax.scan")
        experts = {n: layers[n] for n in EXPERT_PARAMS if n in layers} or None
        scanned = {n: a for n, a in layers.items() if n not in EXPERT_PARAMS}

        def body(carry, xs):
            x, pages = carry
            lp, li = xs
            x, pages = _layer(cfg, x, lp, pages, li, md, cos, sin, kernels, experts)
            return (x, pages), None
        (x, pages), _ = jax.lax.scan(body, (x, kv[0]), (scanned, jnp.arange(cfg.num_layers, dtype=jnp.int32)))
        kv = (pages,)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps, kernels.matmul == "native"), kv


def compute_logits(cfg: ArchConfig, params: dict, hidden: jax.Array, kernels: Kernels = Kernels()) -> jax.Array:
    """hidden [S, D] -> float32 logits [S, V]."""
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return matmul(hidden, w, kernels.linear)


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
from jaxllm.errors import ModelLoadError
from jaxllm.formats import storage
from jaxllm.layers import kv_quant
from jaxllm.layers.attention import AttentionMetadata
from jaxllm.layers.linear import embed, linear, matmul
from jaxllm.layers.mla_attention import MLACache, attend_mla
from jaxllm.layers.moe import Routing, moe_mlp, routed_experts
from jaxllm.layers.norm import rms_norm
from jaxllm.layers.rotary import apply_rope, cos_sin
from jaxllm.models.config import ArchConfig, _eos_tuple, rope_scaling_from_dict
from jaxllm.models.kernels import Kernels
from jaxllm.parallel.sharding import LAYERS, cache_array
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

ROPE_TYPES = ("default", "yarn")
ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def _hf(suffix: str) -> str:
    return "model.layers.{layer}." + suffix


def _dense_layer(a: ArchConfig, i: int) -> bool:
    return not a.layer_is_moe(i)


def _moe_layer(a: ArchConfig, i: int) -> bool:
    return a.layer_is_moe(i)


def _qk_head(a: ArchConfig) -> int:
    return a.qk_nope_head_dim + a.head_dim


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
          _hf("self_attn.q_proj.weight"), when=lambda a: not a.q_lora_rank, native=always),
    Param("q_a", LAYER, MATRIX, ("q_lora", "embed"), lambda a: (a.q_lora_rank, a.hidden_size),
          _hf("self_attn.q_a_proj.weight"), when=lambda a: bool(a.q_lora_rank), native=always),
    Param("q_a_norm", LAYER, VECTOR, ("q_lora",), lambda a: (a.q_lora_rank,),
          _hf("self_attn.q_a_layernorm.weight"), when=lambda a: bool(a.q_lora_rank)),
    Param("q_b", LAYER, MATRIX, ("q_heads", "q_lora"), lambda a: (a.num_heads * _qk_head(a), a.q_lora_rank),
          _hf("self_attn.q_b_proj.weight"), when=lambda a: bool(a.q_lora_rank), native=always),
    # The latent and the shared rotary key, [R + Dr, D]; the latent's norm.
    Param("kv_a", LAYER, MATRIX, ("kv_lora", "embed"), lambda a: (a.kv_lora_rank + a.head_dim, a.hidden_size),
          _hf("self_attn.kv_a_proj_with_mqa.weight"), native=always),
    Param("kv_a_norm", LAYER, VECTOR, ("kv_lora",), lambda a: (a.kv_lora_rank,), _hf("self_attn.kv_a_layernorm.weight")),
    # W_UK and W_UV of every head, [H * (Dn + Dv), R]: read per head by the absorbed form
    # (an einsum, never the native matmul).
    Param("kv_b", LAYER, MATRIX, ("q_heads", "kv_lora"),
          lambda a: (a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
          _hf("self_attn.kv_b_proj.weight")),
    Param("o", LAYER, MATRIX, ("embed", "q_heads"), lambda a: (a.hidden_size, a.num_heads * a.v_head_dim),
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
          _hf("mlp.gate.e_score_correction_bias"), when=lambda a: a.router_scoring == "sigmoid", in_layer=_moe_layer),
    Param("shared_gate", LAYER, MATRIX, ("moe_mlp", "embed"),
          lambda a: (a.shared_experts * a.moe_intermediate_size, a.hidden_size),
          _hf("mlp.shared_experts.gate_proj.weight"), when=lambda a: a.shared_experts > 0, in_layer=_moe_layer,
          native=always),
    Param("shared_up", LAYER, MATRIX, ("moe_mlp", "embed"),
          lambda a: (a.shared_experts * a.moe_intermediate_size, a.hidden_size),
          _hf("mlp.shared_experts.up_proj.weight"), when=lambda a: a.shared_experts > 0, in_layer=_moe_layer,
          native=always),
    Param("shared_down", LAYER, MATRIX, ("embed", "moe_mlp"),
          lambda a: (a.hidden_size, a.shared_experts * a.moe_intermediate_size),
          _hf("mlp.shared_experts.down_proj.weight"), when=lambda a: a.shared_experts > 0, in_layer=_moe_layer,
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


# ----------------------------------------------------------------------------- config

def _mscale(scale: float, m: float = 1.0) -> float:
    import math
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def arch_config(hf, arch: str, where: str) -> ArchConfig:
    """A ``DeepseekV2Config`` / ``DeepseekV3Config`` -> ArchConfig; refuses by name what the
    model does not implement."""
    def get(name, default=None):
        v = getattr(hf, name, None)
        return default if v is None else v

    v3 = arch == "DeepseekV3ForCausalLM"
    refused = {
        # field: (value, what the implementation assumes)
        "hidden_act": (get("hidden_act", "silu"), "silu"),
        "attention_bias": (bool(get("attention_bias", False)), False),
        "mlp_bias": (bool(get("mlp_bias", False)), False),
        "moe_layer_freq": (get("moe_layer_freq", 1), 1),
    }
    for name, (value, supported) in refused.items():
        if value != supported:
            raise ModelLoadError(f"{where}: {name}={value!r} is not supported for {arch} (only {supported!r})")
    heads = int(get("num_attention_heads"))
    if int(get("num_key_value_heads", heads)) != heads:
        raise ModelLoadError(f"{where}: num_key_value_heads={get('num_key_value_heads')} is not supported for {arch}: "
                             f"MLA expands the latent into all {heads} heads (num_key_value_heads must equal it)")
    topk_method = "noaux_tc" if v3 else str(get("topk_method", "greedy"))
    if not v3 and topk_method not in ("greedy", "group_limited_greedy"):
        raise ModelLoadError(f"{where}: topk_method={topk_method!r} is not supported for {arch} "
                             "(greedy, group_limited_greedy)")
    L = int(get("num_hidden_layers"))
    rope = dict(get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", get("rope_theta", 10000.0)))
    scaling = rope_scaling_from_dict(rope, where, ROPE_TYPES)
    rope_dim, nope, v_dim = int(get("qk_rope_head_dim")), int(get("qk_nope_head_dim")), int(get("v_head_dim"))
    kv_rank = int(get("kv_lora_rank"))
    if min(rope_dim, kv_rank, v_dim) <= 0 or nope < 0:
        raise ModelLoadError(f"{where}: kv_lora_rank, qk_rope_head_dim and v_head_dim must be positive "
                             f"(got {kv_rank}, {rope_dim}, {v_dim})")
    scale = (nope + rope_dim) ** -0.5
    if scaling.rope_type != "default" and rope.get("mscale_all_dim"):
        scale *= _mscale(scaling.factor, float(rope["mscale_all_dim"])) ** 2
    num_experts = int(get("n_routed_experts", 0))
    if num_experts <= 0:
        raise ModelLoadError(f"{where}: n_routed_experts must be positive for {arch}")
    top_k = int(get("num_experts_per_tok", 0))
    n_group = int(get("n_group", 1))
    topk_group = int(get("topk_group", 1))
    grouped = v3 or topk_method == "group_limited_greedy"
    if not grouped:
        n_group = topk_group = 1
    if grouped and v3 and n_group > 1 and num_experts // n_group < 2:
        raise ModelLoadError(f"{where}: n_group={n_group} leaves fewer than 2 experts per group "
                             "(a group's score is the sum of its best two)")
    if grouped and top_k > topk_group * (num_experts // max(n_group, 1)):
        raise ModelLoadError(f"{where}: num_experts_per_tok={top_k} exceeds the experts of topk_group={topk_group} "
                             f"of n_group={n_group} groups")
    hidden = int(get("hidden_size"))
    return ArchConfig(
        architecture=arch,
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_layers=L,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=rope_dim,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        bos_token_id=get("bos_token_id"),
        eos_token_ids=_eos_tuple(get("eos_token_id")),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(get("moe_intermediate_size")),
        norm_topk_prob=bool(get("norm_topk_prob", False)) if v3 else False,   # V2's router never renormalises
        attn_scale=scale,
        first_k_dense=min(int(get("first_k_dense_replace", 0)), L),
        shared_experts=int(get("n_shared_experts", 0) or 0),
        router_scoring="sigmoid" if v3 else "softmax",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        kv_lora_rank=kv_rank,
        q_lora_rank=int(get("q_lora_rank", 0) or 0),
        qk_nope_head_dim=nope,
        v_head_dim=v_dim,
        rope_interleave=bool(get("rope_interleave", True)) if v3 else True,
        topk_method=topk_method,
    )


# ----------------------------------------------------------------------------- the cache

def latent_width(arch: ArchConfig) -> int:
    """Values cached per token and layer: the latent and the rotary key."""
    return arch.kv_lora_rank + arch.head_dim


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
    if not cfg.rope_interleave:
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
    if cfg.topk_method == "group_limited_greedy" and cfg.n_group > 1:
        T, E = probs.shape
        G = cfg.n_group
        best = jax.lax.top_k(probs.reshape(T, G, E // G).max(axis=-1), cfg.topk_group)[1]   # [T, topk_group]
        keep = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], best].set(True)
        probs = jnp.where(jnp.repeat(keep, E // G, axis=1), probs, 0.0)
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)   # [T, k]
    return weights * jnp.float32(cfg.routed_scaling_factor), experts.astype(jnp.int32)


def _mlp(cfg: ArchConfig, h, lp, layer, md: AttentionMetadata, kernels: Kernels, experts):
    # h [T, D] -> [T, D]: the dense SwiGLU of the first layers, else routed + shared experts
    mm = kernels.linear
    if "router" not in lp:
        return linear(jax.nn.silu(linear(h, lp["gate"], backend=mm)) * linear(h, lp["up"], backend=mm),
                      lp["down"], backend=mm)
    w = experts if experts is not None else lp
    stack_layer = layer if experts is not None else None
    if cfg.router_scoring == "sigmoid":
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
    H, Dn, Dr, Dv, R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
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


"""Gemma 2 and Gemma 3 (text) decoders as pure functions.

What sets them apart from the Llama family (``models/llama/``), following transformers'
``modeling_gemma2`` / ``modeling_gemma3``:

* RMSNorm scales by ``1 + w`` (computed in float32), and every block is wrapped in two
  norms: ``x + post_norm(attn(input_norm(x)))``, then ``x + post_ffn_norm(mlp(pre_ffn_norm(x)))``;
* GeGLU MLP (``gelu`` with the tanh approximation, transformers' ``gelu_pytorch_tanh``);
* the embedding is multiplied by ``sqrt(hidden_size)`` rounded to the weights' dtype;
* the softmax scale is ``query_pre_attn_scalar ** -0.5``;
* sliding-window and global layers interleaved (``layer_types``; Gemma 2 alternates);
* Gemma 2: attention scores and final logits soft-capped (``c * tanh(s / c)``);
* Gemma 3: RMSNorm (``1 + w``) over each head of q and k, and two RoPE bases: sliding layers
  ``rope_local_base_freq`` (default rope), global layers ``rope_theta`` with their scaling.

Layers that differ in their window (or rope) are static attributes of each layer, so the
model runs unrolled (``engine/resolve.py`` refuses ``--scan-layers`` for it); a checkpoint
whose layers are all alike may be scanned.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.errors import ModelLoadError
from jaxllm.formats.storage import PACKED_BF16
from jaxllm.layers.attention import AttentionMetadata, KVCache, attend
from jaxllm.layers.linear import embed, linear, matmul
from jaxllm.layers.rotary import apply_rope, cos_sin
from jaxllm.models.config import ArchConfig, RopeScaling, _eos_tuple, rope_scaling_from_dict
from jaxllm.models.kernels import Kernels
from jaxllm.models.params import GLOBAL, LAYER, MATRIX, VECTOR, Fused, Param, ParamTable, Stored, always

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


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
          when=lambda a: a.rope_local_theta is not None),
    Param("input_norm", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,), _hf("input_layernorm.weight"),
          _norm(_gguf("attn_norm.weight"))),
    Param("q", LAYER, MATRIX, ("q_heads", "embed"), lambda a: (a.q_size, a.hidden_size),
          _hf("self_attn.q_proj.weight"), _gguf("attn_q.weight"), native=always),
    Param("k", LAYER, MATRIX, ("kv_heads", "embed"), lambda a: (a.kv_size, a.hidden_size),
          _hf("self_attn.k_proj.weight"), _gguf("attn_k.weight"), native=always),
    Param("v", LAYER, MATRIX, ("kv_heads", "embed"), lambda a: (a.kv_size, a.hidden_size),
          _hf("self_attn.v_proj.weight"), _gguf("attn_v.weight"), native=always),
    Param("o", LAYER, MATRIX, ("embed", "q_heads"), lambda a: (a.hidden_size, a.q_size),
          _hf("self_attn.o_proj.weight"), _gguf("attn_output.weight"), native=always),
    Param("q_bias", LAYER, VECTOR, ("q_heads",), lambda a: (a.q_size,), _hf("self_attn.q_proj.bias"),
          _gguf("attn_q.bias"),           when=_if("qkv_bias")),
    Param("k_bias", LAYER, VECTOR, ("kv_heads",), lambda a: (a.kv_size,), _hf("self_attn.k_proj.bias"),
          _gguf("attn_k.bias"),           when=_if("qkv_bias")),
    Param("v_bias", LAYER, VECTOR, ("kv_heads",), lambda a: (a.kv_size,), _hf("self_attn.v_proj.bias"),
          _gguf("attn_v.bias"),           when=_if("qkv_bias")),
    Param("o_bias", LAYER, VECTOR, ("embed",), lambda a: (a.hidden_size,), _hf("self_attn.o_proj.bias"),
          _gguf("attn_output.bias"),           when=_if("o_bias")),
    Param("q_norm", LAYER, VECTOR, ("head_dim",), lambda a: (a.head_dim,), _hf("self_attn.q_norm.weight"),
          _norm(_gguf("attn_q_norm.weight")),           when=_if("qk_norm")),
    Param("k_norm", LAYER, VECTOR, ("head_dim",), lambda a: (a.head_dim,), _hf("self_attn.k_norm.weight"),
          _norm(_gguf("attn_k_norm.weight")),           when=_if("qk_norm")),
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


# ----------------------------------------------------------------------------- config

def arch_config(hf, arch: str, where: str) -> ArchConfig:
    """A Gemma 2 or Gemma 3 text config (``Gemma2Config``, ``Gemma3TextConfig``; a
    ``Gemma3Config`` is read through its text config) -> ArchConfig; refuses by name what the
    model does not implement."""
    if hasattr(hf, "text_config") and getattr(hf, "text_config", None) is not None:
        hf = hf.get_text_config()

    def get(name, default=None):
        v = getattr(hf, name, None)
        return default if v is None else v

    act = get("hidden_activation") or get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"{where}: hidden_activation {act!r} is not supported for {arch} "
                             "(only gelu_pytorch_tanh)")
    if get("use_bidirectional_attention", False):
        raise ModelLoadError(f"{where}: use_bidirectional_attention=true is not supported (a causal decoder only)")
    L = int(get("num_hidden_layers"))
    layer_types = tuple(get("layer_types") or ())
    if len(layer_types) != L or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"{where}: layer_types must name sliding_attention or full_attention for each of "
                             f"the {L} layers, got {list(layer_types)}")
    window = get("sliding_window")
    if "sliding_attention" in layer_types and not window:
        raise ModelLoadError(f"{where}: sliding layers need a positive sliding_window, got {window!r}")
    rope = get("rope_parameters") or {}
    local_theta = None
    if arch == "Gemma3ForCausalLM":
        full = rope.get("full_attention") or {}
        local = rope.get("sliding_attention") or {}
        if (local.get("rope_type") or "default") != "default":
            raise ModelLoadError(f"{where}: the sliding layers' rope_type {local.get('rope_type')!r} is not "
                                 "supported (only default)")
        theta = float(full.get("rope_theta", 1_000_000.0))
        local_theta = float(local.get("rope_theta", 10_000.0))
        scaling = rope_scaling_from_dict(full, where)
    else:
        if "full_attention" in rope:   # a per-layer-type dict (not written by Gemma2Config)
            raise ModelLoadError(f"{where}: per-layer-type rope_parameters are not supported for {arch}")
        theta = float(rope.get("rope_theta", get("rope_theta", 10_000.0)))
        scaling = rope_scaling_from_dict(rope, where)
    heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    bias = bool(get("attention_bias", False))
    return ArchConfig(
        architecture=arch,
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_layers=L,
        num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads", heads)),
        head_dim=int(get("head_dim") or hidden // heads),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(get("tie_word_embeddings", True)),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=arch == "Gemma3ForCausalLM",
        sliding_window=int(window) if window else None,
        bos_token_id=get("bos_token_id"),
        eos_token_ids=_eos_tuple(get("eos_token_id")),
        layer_types=layer_types,
        attn_scale=float(get("query_pre_attn_scalar")) ** -0.5 if get("query_pre_attn_scalar") else None,
        attn_soft_cap=float(get("attn_logit_softcapping")) if get("attn_logit_softcapping") else None,
        final_soft_cap=float(get("final_logit_softcapping")) if get("final_logit_softcapping") else None,
        rope_local_theta=local_theta,
    )


def rope_tables(arch: ArchConfig) -> dict[str, tuple[float, RopeScaling]]:
    """The extra RoPE frequency tables the loader computes: name -> (theta, scaling)."""
    if arch.rope_local_theta is None:
        return {}
    return {"rope_local_inv_freq": (arch.rope_local_theta, RopeScaling())}


# ----------------------------------------------------------------------------- model

def gemma_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: ``norm(x) * (1 + w)``, all in float32, then x's dtype.  x [..., D], w [D]."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def _embed_scale(w) -> np.ndarray:
    """sqrt(hidden) in the embedding's dtype, as transformers multiplies it (bf16: rounded)."""
    dtype = jnp.bfloat16 if getattr(w, "dtype", None) in (PACKED_BF16, jnp.bfloat16) else jnp.float32
    return np.asarray(math.sqrt(w.shape[-1]), dtype)


def _layer(cfg: ArchConfig, i: int, x, lp, kv: KVCache, layer, md: AttentionMetadata, rope, kernels: Kernels):
    # x [T, D]; i: the static layer number (its window and rope); layer: the cache index (scan) or None
    T = x.shape[0]
    mm = kernels.linear
    eps = cfg.rms_norm_eps
    h = gemma_norm(x, lp["input_norm"], eps)
    if "qkv" in lp:
        q, k, v = jnp.split(linear(h, lp["qkv"], lp.get("qkv_bias"), mm), [cfg.q_size, cfg.q_size + cfg.kv_size],
                            axis=-1)
    else:
        q, k, v = (linear(h, lp[n], lp.get(n + "_bias"), mm) for n in ("q", "k", "v"))
    q = q.reshape(T, cfg.num_heads, cfg.head_dim)                       # [T, Hq, Dh]
    k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)                    # [T, Hkv, Dh]
    v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q, k = gemma_norm(q, lp["q_norm"], eps), gemma_norm(k, lp["k_norm"], eps)
    window = cfg.window(i)
    cos, sin = rope["local" if window is not None and "local" in rope else "global"]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
    o, kv = attend(q, k, v, kv, layer, md, scale=scale, sliding_window=window, soft_cap=cfg.attn_soft_cap,
                   backend=kernels.attention)                           # [T, Hq, Dh]
    x = x + gemma_norm(linear(o.reshape(T, cfg.q_size), lp["o"], lp.get("o_bias"), mm), lp["post_norm"], eps)
    h = gemma_norm(x, lp["pre_ffn_norm"], eps)
    if "gate_up" in lp:
        gate, up = jnp.split(linear(h, lp["gate_up"], backend=mm), 2, axis=-1)   # [T, F] each
    else:
        gate, up = linear(h, lp["gate"], backend=mm), linear(h, lp["up"], backend=mm)
    y = linear(jax.nn.gelu(gate, approximate=True) * up, lp["down"], backend=mm)
    return x + gemma_norm(y, lp["post_ffn_norm"], eps), kv


def forward(cfg: ArchConfig, params: dict, kv: KVCache, input_ids: jax.Array, md: AttentionMetadata,
            kernels: Kernels = Kernels()) -> tuple[jax.Array, KVCache]:
    """input_ids [T] -> final hidden states [T, D] and the updated cache."""
    native = kernels.matmul == "native"
    x = embed(params["embed"], input_ids, panels=native and cfg.tie_word_embeddings)   # [T, D]
    if native:
        x = x.astype(jnp.float32)
    x = x * _embed_scale(params["embed"]).astype(x.dtype)
    rope = {"global": cos_sin(md.positions, params["rope_inv_freq"])}   # [T, Dh/2] each
    if "rope_local_inv_freq" in params:
        rope["local"] = cos_sin(md.positions, params["rope_local_inv_freq"])
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        ks, vs = list(kv[0]), list(kv[1])
        for i, lp in enumerate(layers):
            x, (ks[i], vs[i]) = _layer(cfg, i, x, lp, (ks[i], vs[i]), None, md, rope, kernels)
        kv = (ks, vs)
    else:
        if not cfg.uniform_layers:
            raise ValueError(f"{cfg.architecture}: layers with different windows cannot run under lax.scan")

        def body(carry, xs):
            x, kv = carry
            lp, li = xs
            x, kv = _layer(cfg, 0, x, lp, kv, li, md, rope, kernels)
            return (x, kv), None
        (x, kv), _ = jax.lax.scan(body, (x, kv), (layers, jnp.arange(cfg.num_layers, dtype=jnp.int32)))
    return gemma_norm(x, params["final_norm"], cfg.rms_norm_eps), kv


def compute_logits(cfg: ArchConfig, params: dict, hidden: jax.Array, kernels: Kernels = Kernels()) -> jax.Array:
    """hidden [S, D] -> float32 logits [S, V], soft-capped when the config says so."""
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    logits = matmul(hidden, w, kernels.linear)
    if cfg.final_soft_cap is not None:
        logits = cfg.final_soft_cap * jnp.tanh(logits / cfg.final_soft_cap)
    return logits

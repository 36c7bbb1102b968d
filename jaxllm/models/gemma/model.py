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

from jaxllm.formats.storage import PACKED_BF16
from jaxllm.layers.attention import AttentionMetadata, KVCache, attend
from jaxllm.layers.linear import embed, linear, matmul
from jaxllm.layers.rotary import apply_rope, cos_sin
from jaxllm.lora import apply as lora_apply
from jaxllm.lora.apply import LoRAStep
from jaxllm.models.config import ArchConfig
from jaxllm.models.kernels import Kernels


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


def _layer(cfg: ArchConfig, i: int, x, lp, kv: KVCache, layer, md: AttentionMetadata, rope, kernels: Kernels,
           lora: LoRAStep | None = None, index=None):
    # x [T, D]; i: the static layer number (its window and rope); layer: the cache index (scan) or None
    # lora: the step's adapters (lora/apply.py), added to the projections at layer ``index``
    T = x.shape[0]
    mm = kernels.linear
    eps = cfg.rms_norm_eps
    h = gemma_norm(x, lp["input_norm"], eps)
    if "qkv" in lp:
        qkv = lora_apply.add_fused(linear(h, lp["qkv"], lp.get("qkv_bias"), mm), lora, ("q", "k", "v"), h, index)
        q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
    else:
        q, k, v = lora_apply.add_each(tuple(linear(h, lp[n], lp.get(n + "_bias"), mm) for n in ("q", "k", "v")),
                                      lora, ("q", "k", "v"), h, index)
    q = q.reshape(T, cfg.num_heads, cfg.head_dim)                       # [T, Hq, Dh]
    k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)                    # [T, Hkv, Dh]
    v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q, k = gemma_norm(q, lp["q_norm"], eps), gemma_norm(k, lp["k_norm"], eps)
    window = cfg.window(i)
    cos, sin = rope["local" if window is not None and "local" in rope else "global"]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
    o, kv = attend(q, k, v, kv, layer, md, scale=scale, sliding_window=window, soft_cap=cfg.gemma.attn_soft_cap,
                   backend=kernels.attention)                           # [T, Hq, Dh]
    o = o.reshape(T, cfg.q_size)
    o = lora_apply.add(linear(o, lp["o"], lp.get("o_bias"), mm), lora, "o", o, index)
    x = x + gemma_norm(o, lp["post_norm"], eps)
    h = gemma_norm(x, lp["pre_ffn_norm"], eps)
    if "gate_up" in lp:
        gate_up = lora_apply.add_fused(linear(h, lp["gate_up"], backend=mm), lora, ("gate", "up"), h, index)
        gate, up = jnp.split(gate_up, 2, axis=-1)                       # [T, F] each
    else:
        gate, up = lora_apply.add_each((linear(h, lp["gate"], backend=mm), linear(h, lp["up"], backend=mm)),
                                       lora, ("gate", "up"), h, index)
    a = jax.nn.gelu(gate, approximate=True) * up
    y = lora_apply.add(linear(a, lp["down"], backend=mm), lora, "down", a, index)
    return x + gemma_norm(y, lp["post_ffn_norm"], eps), kv


def forward(cfg: ArchConfig, params: dict, kv: KVCache, input_ids: jax.Array, md: AttentionMetadata,
            kernels: Kernels = Kernels(), lora: LoRAStep | None = None,
            image_rows: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, KVCache]:
    """input_ids [T] -> final hidden states [T, D] and the updated cache.
    ``lora``: the step's LoRA adapters and each token's slot (None: the base model only).
    ``image_rows``: (row [T] int32, -1 for a text token; embeds [N, D]): a token with a row takes
    that image embedding (models/gemma3_vl/vision.py) instead of its scaled token embedding."""
    native = kernels.matmul == "native"
    x = embed(params["embed"], input_ids, panels=native and cfg.tie_word_embeddings)   # [T, D]
    if native:
        x = x.astype(jnp.float32)
    x = x * _embed_scale(params["embed"]).astype(x.dtype)
    if image_rows is not None:
        row, embeds = image_rows
        # after the sqrt(D) scale, as transformers scatters image features into inputs_embeds
        picked = embeds.astype(x.dtype)[jnp.maximum(row, 0)]            # [T, D]
        x = jnp.where((row >= 0)[:, None], picked, x)
    rope = {"global": cos_sin(md.positions, params["rope_inv_freq"])}   # [T, Dh/2] each
    if "rope_local_inv_freq" in params:
        rope["local"] = cos_sin(md.positions, params["rope_local_inv_freq"])
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        ks, vs = list(kv[0]), list(kv[1])
        for i, lp in enumerate(layers):
            x, (ks[i], vs[i]) = _layer(cfg, i, x, lp, (ks[i], vs[i]), None, md, rope, kernels, lora, i)
        kv = (ks, vs)
    else:
        if not cfg.uniform_layers:
            raise ValueError(f"{cfg.architecture}: layers with different windows cannot run under lax.scan")

        def body(carry, xs):
            x, kv = carry
            lp, li = xs
            x, kv = _layer(cfg, 0, x, lp, kv, li, md, rope, kernels, lora, li)
            return (x, kv), None
        (x, kv), _ = jax.lax.scan(body, (x, kv), (layers, jnp.arange(cfg.num_layers, dtype=jnp.int32)))
    return gemma_norm(x, params["final_norm"], cfg.rms_norm_eps), kv


def compute_logits(cfg: ArchConfig, params: dict, hidden: jax.Array, kernels: Kernels = Kernels()) -> jax.Array:
    """hidden [S, D] -> float32 logits [S, V], soft-capped when the config says so."""
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    logits = matmul(hidden, w, kernels.linear)
    cap = cfg.gemma.final_soft_cap
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    return logits

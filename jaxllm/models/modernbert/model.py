"""ModernBERT's encoder forward over a flat ragged batch: token embeddings and a LayerNorm (no
token types, no absolute positions), then pre-LN blocks (rotary self-attention, GeGLU MLP) and a
final LayerNorm; and a cross-encoder's head.

Attention is bidirectional within each prompt and never crosses prompts (every prompt of a step
is whole in that step, as for BERT).  Global layers see the whole prompt with RoPE base
``arch.rope_theta``; local layers (``arch.layer_types``) see the tokens at most ``half_window``
away on either side, with RoPE base ``local_rope_theta``.  It is plain XLA: a dense ``[H, T, T]``
score block under a mask, as BERT's (``models/bert/model.py`` says why).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.layers.rotary import RopeScaling, apply_rope, cos_sin, inv_frequencies
from jaxllm.models.config import ArchConfig
from jaxllm.models.modernbert.config import encoder


def _layer_norm(x, w, b, eps: float):
    """x [T, D] float32 -> [T, D]; torch's LayerNorm (biased variance), ``b`` None: no bias."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps) * w
    return y if b is None else y + b


def _linear(x, w, b=None):
    """x [T, in] @ w [out, in]^T (+ b [out]), float32 accumulation."""
    y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y if b is None else y + b


def _attention(arch: ArchConfig, lp: dict, x, mask, cos, sin):
    """x [T, D]; mask [T, T] bool (query t may see key s); cos, sin [T, Dh/2] -> [T, D]."""
    T = x.shape[0]
    H, Dh = arch.num_heads, arch.head_dim
    q = apply_rope(_linear(x, lp["q"], lp.get("q_bias")).reshape(T, H, Dh), cos, sin)
    k = apply_rope(_linear(x, lp["k"], lp.get("k_bias")).reshape(T, H, Dh), cos, sin)
    v = _linear(x, lp["v"], lp.get("v_bias")).reshape(T, H, Dh)
    scores = jnp.einsum("thd,shd->hts", q, k, preferred_element_type=jnp.float32) * (Dh ** -0.5)   # [H, T, T]
    scores = jnp.where(mask[None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)        # every row sees at least its own token: no NaN
    out = jnp.einsum("hts,shd->thd", probs, v, preferred_element_type=jnp.float32).reshape(T, H * Dh)
    return _linear(out, lp["o"], lp.get("o_bias"))


def _rope(arch: ArchConfig, theta: float, positions):
    """cos, sin [T, Dh/2] for RoPE base ``theta`` (the frequencies are compile-time constants)."""
    return cos_sin(positions, jnp.asarray(inv_frequencies(arch.head_dim, theta, RopeScaling())))


def encode(arch: ArchConfig, params: dict, input_ids, positions, seq_ids, token_types, max_len: int | None = None,
           rows: int | None = None):
    """The encoder's last hidden states (after the final norm).

    input_ids [T] int32, positions [T] int32 (each token's index in its prompt), seq_ids [T]
    int32 (the prompt each token belongs to; padding tokens carry -1), token_types [T] int32
    (unused: ModernBERT has no token types) -> hidden [T, D] float32; ``max_len``, ``rows``
    (unused: its attention is dense; BERT's picks a layout by them).  ``params``:
    ``{"globals": {...}, "layers": [{...}, ...]}`` (layer 0 has no ``attn_norm``: an identity)."""
    enc = encoder(arch)
    g = params["globals"]
    eps = enc.norm_eps
    x = _layer_norm(g["embed"][input_ids].astype(jnp.float32), g["embed_norm"], g.get("embed_norm_bias"), eps)
    full = seq_ids[:, None] == seq_ids[None, :]                                            # [T, T]
    local = full & (jnp.abs(positions[:, None] - positions[None, :]) <= enc.half_window)    # [T, T]
    rope = {"full_attention": _rope(arch, arch.rope_theta, positions),
            "sliding_attention": _rope(arch, enc.local_rope_theta, positions)}
    masks = {"full_attention": full, "sliding_attention": local}
    # Unrolled: layer 0 differs (no attention norm) and the layer types alternate.
    for i, lp in enumerate(params["layers"]):
        kind = arch.layer_types[i]
        h = x if "attn_norm" not in lp else _layer_norm(x, lp["attn_norm"], lp.get("attn_norm_bias"), eps)
        x = x + _attention(arch, lp, h, masks[kind], *rope[kind])
        h = _layer_norm(x, lp["mlp_norm"], lp.get("mlp_norm_bias"), eps)
        up = jax.nn.gelu(_linear(h, lp["up"], lp.get("up_bias")), approximate=enc.gelu_tanh)   # [T, F]
        x = x + _linear(up * _linear(h, lp["gate"], lp.get("gate_bias")), lp["down"], lp.get("down_bias"))
    return _layer_norm(x, g["final_norm"], g.get("final_norm_bias"), eps)


def classify(arch: ArchConfig, params: dict, hidden, seq_ids, query_start_loc):
    """A cross-encoder's head: hidden [T, D], seq_ids [T], query_start_loc [S+1] (the runner's
    step layout) -> logits [S, num_labels].  It reads each prompt's first token
    (``classifier_pooling`` "cls") or the mean over its tokens ("mean"), then
    ``classifier(norm(act(dense(.))))``."""
    enc = encoder(arch)
    g = params["globals"]
    S = query_start_loc.shape[0] - 1
    if enc.classifier_pooling == "cls":
        pooled = hidden[query_start_loc[:-1]]                                                   # [S, D]
    else:
        member = (seq_ids[None, :] == jnp.arange(S, dtype=seq_ids.dtype)[:, None]).astype(jnp.float32)   # [S, T]
        sums = jax.lax.dot_general(member, hidden, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                                   precision=jax.lax.Precision.HIGHEST)                        # [S, D]
        pooled = sums / jnp.maximum(jnp.sum(member, axis=1, keepdims=True), 1.0)              # padding rows: 0
    h = jax.nn.gelu(_linear(pooled, g["head_dense"], g.get("head_dense_bias")), approximate=enc.classifier_gelu_tanh)
    h = _layer_norm(h, g["head_norm"], g.get("head_norm_bias"), enc.norm_eps)
    return _linear(h, g["classifier"], g["classifier_bias"])

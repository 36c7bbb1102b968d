"""BERT's encoder forward over a flat ragged batch: word + absolute position + token-type
embeddings, LayerNorm, then post-LN blocks (self-attention, GELU MLP).

Attention is bidirectional within each prompt and never crosses prompts: every prompt of a
step is whole in that step (the pooling runner schedules it so), so a token attends over its
own sequence's tokens of this step and no K/V is kept afterwards.  It is plain XLA (a dense
``[H, T, T]`` score block under a same-sequence mask): the paged native CPU and Pallas kernels
are causal and read K/V from pages, which an encoder does not need.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.models.bert.config import encoder
from jaxllm.models.config import ArchConfig


def _layer_norm(x, w, b, eps: float):
    """x [T, D] float32 -> [T, D]; torch's LayerNorm (biased variance)."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * w + b


def _linear(x, w, b):
    """x [T, in] @ w [out, in]^T + b [out], float32 accumulation."""
    y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y + b


def _attention(arch: ArchConfig, lp: dict, x, same_seq):
    """x [T, D]; same_seq [T, T] bool (query t may see key s) -> [T, D]."""
    T = x.shape[0]
    H, Dh = arch.num_heads, arch.head_dim
    q = _linear(x, lp["q"], lp["q_bias"]).reshape(T, H, Dh)
    k = _linear(x, lp["k"], lp["k_bias"]).reshape(T, H, Dh)
    v = _linear(x, lp["v"], lp["v_bias"]).reshape(T, H, Dh)
    scores = jnp.einsum("thd,shd->hts", q, k, preferred_element_type=jnp.float32) * (Dh ** -0.5)   # [H, T, T]
    scores = jnp.where(same_seq[None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)        # every row sees at least its own token: no NaN
    out = jnp.einsum("hts,shd->thd", probs, v, preferred_element_type=jnp.float32).reshape(T, H * Dh)
    return _linear(out, lp["o"], lp["o_bias"])


def encode(arch: ArchConfig, params: dict, input_ids, positions, seq_ids, token_types):
    """The encoder's last hidden states.

    input_ids [T] int32, positions [T] int32 (each token's index in its prompt), seq_ids [T]
    int32 (the prompt each token belongs to; padding tokens carry their own id, -1),
    token_types [T] int32 (0 for a single text; a pair's second text 1) -> hidden [T, D]
    float32.  ``params``: ``{"globals": {...}, "layers": [{...}, ...]}``."""
    enc = encoder(arch)
    g = params["globals"]
    x = (g["embed"][input_ids] + g["pos_embed"][positions + enc.position_offset]
         + g["type_embed"][token_types])                                     # [T, D]
    x = _layer_norm(x.astype(jnp.float32), g["embed_norm"], g["embed_norm_bias"], enc.layer_norm_eps)
    same_seq = seq_ids[:, None] == seq_ids[None, :]                          # [T, T]
    for lp in params["layers"]:
        x = _layer_norm(x + _attention(arch, lp, x, same_seq), lp["attn_norm"], lp["attn_norm_bias"],
                        enc.layer_norm_eps)
        h = jax.nn.gelu(_linear(x, lp["up"], lp["up_bias"]), approximate=enc.gelu_tanh)   # [T, F]
        x = _layer_norm(x + _linear(h, lp["down"], lp["down_bias"]), lp["mlp_norm"], lp["mlp_norm_bias"],
                        enc.layer_norm_eps)
    return x


def classify(arch: ArchConfig, params: dict, hidden, seq_ids, query_start_loc):
    """A cross-encoder's head: hidden [T, D], seq_ids [T], query_start_loc [S+1] (the runner's
    step layout) -> logits [S, num_labels], from each prompt's first token (``[CLS]`` / ``<s>``):
    BERT's ``classifier(tanh(pooler(.)))``, the same sum as RoBERTa's
    ``out_proj(tanh(dense(.)))`` (``params.py`` maps either's names)."""
    g = params["globals"]
    first = hidden[query_start_loc[:-1]]                                   # [S, D]
    pooled = jnp.tanh(_linear(first, g["pooler"], g["pooler_bias"]))
    return _linear(pooled, g["classifier"], g["classifier_bias"])

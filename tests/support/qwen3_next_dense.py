"""A dense-cache reference harness for the hybrid family (Qwen3-Next / Qwen3.5, jaxllm/models/qwen3_next.py),
used by tests/models/test_qwen3_next.py only: an HF folder loaded into jnp arrays, a per-row
dense K/V cache and GDN states, a jitted forward over padded batches and a greedy
``generate``.  It checks the family's layers against transformers independently of the
engine's paged path (tests/models/test_qwen3_next_engine.py)."""

from __future__ import annotations

import itertools
import json
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from transformers import AutoConfig

from jaxllm.errors import ModelLoadError
from jaxllm.layers.linear import linear, matmul
from jaxllm.layers.rotary import apply_rope, cos_sin, inv_frequencies
from jaxllm.models.config import RopeScaling
from jaxllm.models.loader import NameMap, _assemble, read_safetensors
from jaxllm.models.qwen3_next import ARCHITECTURES, PARAMS, HybridConfig, config_from_hf, mlp
from jaxllm.models.qwen3_next.model import _gdn_mix, _gdn_out, _gdn_projections, _norm


def rope_inv_freq(cfg: HybridConfig) -> np.ndarray:
    """[rotary_dim / 2] float32, as transformers computes them."""
    return inv_frequencies(cfg.rotary_dim, cfg.rope_theta, RopeScaling())


def load(path: str, dtype=jnp.float32) -> tuple[HybridConfig, dict]:
    """An HF folder (config.json + *.safetensors) -> (config, params): ``params["layers"]`` a
    list of per-layer dicts (the layer kinds differ), every array ``dtype`` (vectors float32)."""
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: cannot read it ({e})") from None
    archs = raw.get("architectures") or []
    if not archs or archs[0] not in ARCHITECTURES:
        raise ModelLoadError(f"{cfg_path}: architectures {archs} is not one of {', '.join(ARCHITECTURES)}")
    try:
        hf = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 -- transformers raises many types for a bad config
        raise ModelLoadError(f"{cfg_path}: transformers cannot read it ({e})") from None
    cfg = config_from_hf(hf, archs[0], cfg_path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    tensors = {}
    for fname in files:
        for name, arr in read_safetensors(os.path.join(path, fname)).items():
            # Multi-token-prediction heads and a Qwen3.5 vision tower are not used (transformers
            # skips them too); a tied head saved anyway is the embedding.
            if name.startswith(("mtp.", "model.visual.")) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            tensors[name] = (arr, fname)
    layers, globals_ = _assemble(cfg, tensors, NameMap(cfg, "hf"), where=path)
    matrices = PARAMS.matrices()

    def dev(name, a):
        return jnp.asarray(np.asarray(a, np.float32), dtype if name in matrices else jnp.float32)

    params = {n: dev(n, a) for n, a in globals_.items()}
    params["rope_inv_freq"] = jnp.asarray(rope_inv_freq(cfg))
    params["layers"] = [{n: dev(n, a) for n, a in lp.items()} for lp in layers]
    return cfg, params


GDN_DECODE = ("xla", "pallas")
"""Implementations of the GDN decode step: ``layers/gated_delta.py``'s scan, or
``pallas/gated_delta.py``'s kernel (interpret mode on CPU)."""


def gdn_layer(cfg: HybridConfig, h, lp, state, length=None, *, chunk_size: int, decode: str = "xla"):
    """A Gated DeltaNet token mixer: h [B, T, D] (normed), state (conv [B, K - 1, C], delta
    [B, Hv, Dk, Dv]), length [B] (the real tokens of each row; None: all) -> ([B, T, D],
    state).  T == 1 takes the recurrent (decode) form, computed by ``decode`` (one of
    :data:`GDN_DECODE`), every row real."""
    B, T, D = h.shape
    mixed, z, b, a = _gdn_projections(cfg, h.reshape(B * T, D), lp)
    Hv = cfg.linear_num_value_heads
    o, state = _gdn_mix(cfg, lp, mixed.reshape(B, T, cfg.conv_dim), b.reshape(B, T, Hv), a.reshape(B, T, Hv),
                        state, length, chunk_size=chunk_size, decode=decode)
    out = _gdn_out(cfg, lp, o.reshape(B * T, Hv, -1), z, h.dtype)
    return out.reshape(B, T, D), state


def attention_layer(cfg: HybridConfig, h, lp, kv, pos, length, cos, sin):
    """Gated full attention over a dense cache: h [B, T, D] (normed), kv (k, v [B, S, Hkv, Dh]),
    pos [B]: each row's tokens before this call, length [B]: its real tokens in it ->
    ([B, T, D], kv).  Padding tokens write nothing."""
    B, T, D = h.shape
    H, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = h.reshape(B * T, D)
    qg = linear(x, lp["q"]).reshape(B * T, H, 2 * Dh)
    q, gate = qg[..., :Dh], qg[..., Dh:].reshape(B, T, H * Dh)        # each head: query, then its gate
    q = _norm(q, lp["q_norm"], cfg.rms_norm_eps)
    k = _norm(linear(x, lp["k"]).reshape(B * T, Hkv, Dh), lp["k_norm"], cfg.rms_norm_eps)
    v = linear(x, lp["v"]).reshape(B, T, Hkv, Dh)
    q = apply_rope(q, cos, sin).reshape(B, T, H, Dh)                   # partial: first rotary_dim dims
    k = apply_rope(k, cos, sin).reshape(B, T, Hkv, Dh)
    kc, vc = kv
    S = kc.shape[1]
    qpos = pos[:, None] + jnp.arange(T)[None, :]                       # [B, T] each token's position
    slot = jnp.where(jnp.arange(T)[None, :] < length[:, None], qpos, S)   # padding: out of range, dropped
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    kc = kc.at[rows, slot].set(k.astype(kc.dtype), mode="drop")
    vc = vc.at[rows, slot].set(v.astype(vc.dtype), mode="drop")
    qh = q.reshape(B, T, Hkv, H // Hkv, Dh).astype(jnp.float32)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qh, kc.astype(jnp.float32)) * Dh ** -0.5
    visible = jnp.arange(S)[None, None, :] <= qpos[:, :, None]        # [B, T, S] causal
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bgrts,bsgd->btgrd", p, vc.astype(jnp.float32)).reshape(B, T, H * Dh)
    o = o * jax.nn.sigmoid(gate.astype(jnp.float32))
    out = linear(o.reshape(B * T, H * Dh).astype(h.dtype), lp["o"])
    return out.reshape(B, T, D), (kc, vc)


def init_cache(cfg: HybridConfig, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    """The harness's cache: per full-attention layer dense K/V ``[B, max_len, Hkv, Dh]``, per
    GDN layer its conv state ``[B, K - 1, C]`` and delta state ``[B, Hv, Dk, Dv]`` (float32),
    and ``pos [B]``: each row's tokens so far."""
    layers = []
    for i in range(cfg.num_layers):
        if cfg.is_linear(i):
            layers.append((jnp.zeros((batch, cfg.conv_kernel - 1, cfg.conv_dim), jnp.float32),
                           jnp.zeros((batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                      cfg.linear_value_head_dim), jnp.float32)))
        else:
            shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
            layers.append((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))
    return {"pos": jnp.zeros((batch,), jnp.int32), "layers": layers}


@partial(jax.jit, static_argnames=("cfg", "chunk_size", "gdn_decode"))
def dense_forward(cfg: HybridConfig, params: dict, cache: dict, input_ids: jax.Array, length: jax.Array | None = None, *,
            chunk_size: int = 64, gdn_decode: str = "xla") -> tuple[jax.Array, dict]:
    """input_ids [B, T] continuing the cache's sequences, the first ``length [B]`` of each row
    real (None: all; the rest padding, which changes no state) -> (float32 logits [B, T, V],
    garbage at padding, and the cache after them).  T > 1: chunked prefill (GDN in chunks of
    ``chunk_size``); T == 1: a decode step (the recurrent form, by ``gdn_decode``; every row
    real)."""
    if gdn_decode not in GDN_DECODE:
        raise ValueError(f"gdn_decode must be one of {GDN_DECODE}, got {gdn_decode!r}")
    B, T = input_ids.shape
    if T == 1 and length is not None:
        raise ValueError("a decode step (T == 1) takes every row as real: pass length=None")
    pos = cache["pos"]                                                 # [B]
    gdn_length = length
    length = jnp.full((B,), T, jnp.int32) if length is None else length.astype(jnp.int32)
    x = params["embed"][input_ids]                                     # [B, T, D]
    positions = pos[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]   # [B, T]
    cos, sin = cos_sin(positions.reshape(B * T), params["rope_inv_freq"])   # [B * T, R/2]
    new_layers = []
    for i, (lp, st) in enumerate(zip(params["layers"], cache["layers"])):
        h = _norm(x, lp["input_norm"], cfg.rms_norm_eps)
        if cfg.is_linear(i):
            y, st = gdn_layer(cfg, h, lp, st, gdn_length, chunk_size=chunk_size, decode=gdn_decode)
        else:
            y, st = attention_layer(cfg, h, lp, st, pos, length, cos, sin)
        x = x + y
        h = _norm(x, lp["post_norm"], cfg.rms_norm_eps)
        x = x + mlp(cfg, h.reshape(B * T, -1), lp).reshape(B, T, -1)
        new_layers.append(st)
    x = _norm(x, params["final_norm"], cfg.rms_norm_eps)
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    logits = matmul(x.reshape(B * T, -1), w).reshape(B, T, -1)
    return logits, {"pos": pos + length, "layers": new_layers}


def generate(cfg: HybridConfig, params: dict, prompts, max_new_tokens: int, *,
             prefill_chunks: int = 1, chunk_size: int = 64, max_len: int | None = None,
             gdn_decode: str = "xla") -> np.ndarray:
    """Greedy tokens after each prompt (a [B, P] array, or a list of B token lists of any
    lengths, padded at the end into one batch): the prompts prefilled together in
    ``prefill_chunks`` calls over the longest one's length (a row whose prompt has ended
    pads, leaving its states as they are), then one decode step per token for all rows ->
    [B, max_new_tokens]."""
    rows = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    lens = np.asarray([len(r) for r in rows], np.int32)
    if lens.min() < 1:
        raise ValueError("every prompt needs at least one token")
    B, P = len(rows), int(lens.max())
    if not 1 <= prefill_chunks <= P:
        raise ValueError(f"prefill_chunks must be in [1, {P}] (the longest prompt), got {prefill_chunks}")
    batch = np.zeros((B, P), np.int32)
    for b, r in enumerate(rows):
        batch[b, :len(r)] = r
    cache = init_cache(cfg, B, max_len or P + max_new_tokens)
    last = np.zeros((B, cfg.vocab_size), np.float32)     # each row's logits after its last prompt token
    for lo, hi in itertools.pairwise(np.linspace(0, P, prefill_chunks + 1).astype(int)):
        n = np.clip(lens - lo, 0, hi - lo).astype(np.int32)                # [B] real tokens in this call
        logits, cache = dense_forward(cfg, params, cache, jnp.asarray(batch[:, lo:hi]), jnp.asarray(n),
                                chunk_size=chunk_size)
        ends = (lens > lo) & (lens <= hi)
        last[ends] = np.asarray(logits)[np.flatnonzero(ends), lens[ends] - 1 - lo]
    out = []
    tok = jnp.asarray(last.argmax(axis=-1).astype(np.int32))
    for _ in range(max_new_tokens):
        out.append(tok)
        if len(out) == max_new_tokens:
            break
        logits, cache = dense_forward(cfg, params, cache, tok[:, None], chunk_size=chunk_size, gdn_decode=gdn_decode)
        tok = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    return np.stack([np.asarray(t) for t in out], axis=1)


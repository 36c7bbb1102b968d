"""The model as a plain function, for notebooks and research: no engine, no paged cache.

    from jaxllm import functional
    params, forward = functional.load()                 # built-in SmolLM2-135M-Instruct, float32
    logits = forward(params, tokens)                    # tokens [B, L] int32 -> logits [B, L, V] float32
    logprobs = jax.nn.log_softmax(logits, axis=-1)

``forward`` is ``jax.jit`` of a pure function of ``(params, tokens)``: differentiate it,
``vmap`` it, lower it (``forward.lower(params, tokens).as_text()``), or swap weights in
``params`` and call it again.  Each row of ``tokens`` is one sequence starting at position 0
(no padding, no cache), attended densely and causally (with the checkpoint's sliding window,
if any); the result is the full-sequence forward the engine computes chunk by chunk through
its paged KV cache, and equals transformers' logits (tests/models/test_functional.py).

``params`` has the engine's layout (``jaxllm/runner/weights.py``, unrolled; every parameter is
declared in the model's table, ``jaxllm/models/llama/: PARAMS``): a dict with
``embed``, ``final_norm``, ``lm_head`` (untied checkpoints), ``rope_inv_freq`` and ``layers``,
a list of per-layer dicts (``input_norm``, ``q``, ``k``, ``v``, ``o``, ``post_norm``, ``gate``,
``up``, ``down`` (MoE checkpoints: ``router``, ``experts_gate``, ``experts_up``, ``experts_down``),
and the architecture's biases / q-k norms), matrices in transformers' ``[out, in]`` layout.
``forward.arch`` is the ``ArchConfig``; ``forward.name`` the model name.

The layer is built from the same pieces as ``jaxllm/models/llama/`` (``rms_norm``,
``linear``, ``apply_rope``, ``cos_sin``); only the attention differs (dense instead of paged).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.errors import ModelLoadError
from jaxllm.formats import storage
from jaxllm.layers.linear import linear, matmul
from jaxllm.layers.moe import moe_mlp
from jaxllm.layers.norm import rms_norm
from jaxllm.layers.rotary import apply_rope, cos_sin
from jaxllm.lora import apply as lora_apply
from jaxllm.lora.apply import LoRAStep
from jaxllm.models.config import ArchConfig
from jaxllm.models.llama.variants import FAMILY_B
from jaxllm.models.loader import gguf_file, load_model
from jaxllm.runner.weights import to_device_params

_MASK_VALUE = -1e30


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                    sliding_window: int | None = None) -> jax.Array:
    """Causal attention of whole sequences: q [B, L, Hq, Dh], k/v [B, L, Hkv, Dh] -> [B, L, Hq, Dh].

    Grouped-query heads share their K/V head (query head h reads K/V head h // (Hq // Hkv)),
    scores and softmax in float32."""
    B, L, Hq, Dh = q.shape
    Hkv = k.shape[2]
    qg = (q.astype(jnp.float32) * scale).reshape(B, L, Hkv, Hq // Hkv, Dh)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32))           # [B, Hkv, G, L, L]
    qpos = jnp.arange(L)[:, None]
    kpos = jnp.arange(L)[None, :]
    allowed = kpos <= qpos
    if sliding_window is not None:
        allowed &= qpos - kpos < sliding_window
    s = jnp.where(allowed, s, _MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32))
    return o.reshape(B, L, Hq, Dh).astype(q.dtype)


def _layer(cfg: ArchConfig, x, lp, cos, sin, B: int, L: int, lora: LoRAStep | None = None, index: int = 0):
    # x [B*L, D]; cos, sin [B*L, Dh/2]; lora: adapters added to the projections of layer
    # ``index`` by the engine's own lora/apply.py (None: the base model)
    T = x.shape[0]
    h = rms_norm(x, lp["input_norm"], cfg.rms_norm_eps)
    q = lora_apply.add(linear(h, lp["q"], lp.get("q_bias")), lora, "q", h, index).reshape(T, cfg.num_heads, cfg.head_dim)
    k = lora_apply.add(linear(h, lp["k"], lp.get("k_bias")), lora, "k", h, index).reshape(T, cfg.num_kv_heads, cfg.head_dim)
    v = lora_apply.add(linear(h, lp["v"], lp.get("v_bias")), lora, "v", h, index).reshape(T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o = dense_attention(q.reshape(B, L, *q.shape[1:]), k.reshape(B, L, *k.shape[1:]), v.reshape(B, L, *v.shape[1:]),
                        scale=cfg.head_dim ** -0.5, sliding_window=cfg.sliding_window)
    o = o.reshape(T, cfg.q_size)
    x = x + lora_apply.add(linear(o, lp["o"], lp.get("o_bias")), lora, "o", o, index)
    h = rms_norm(x, lp["post_norm"], cfg.rms_norm_eps)
    if cfg.is_moe:
        # Qwen3-MoE, Mixtral.  The dense expert path (the same function) stays differentiable:
        # the engine's grouped one loops with data-dependent trip counts, which jax.grad refuses.
        return x + moe_mlp(h, lp["router"], lp["experts_gate"], lp["experts_up"], lp["experts_down"],
                           cfg.num_experts_per_tok, cfg.norm_topk_prob, impl="dense")
    gate = lora_apply.add(linear(h, lp["gate"]), lora, "gate", h, index)
    up = lora_apply.add(linear(h, lp["up"]), lora, "up", h, index)
    a = jax.nn.silu(gate) * up
    return x + lora_apply.add(linear(a, lp["down"]), lora, "down", a, index)


def hidden_states(cfg: ArchConfig, params: dict, tokens: jax.Array, lora: LoRAStep | None = None) -> jax.Array:
    """tokens [B, L] int -> final (normed) hidden states [B, L, D].  ``lora``: a
    :class:`LoRAStep` whose ``slots`` are ``[B*L]`` (the tokens row-major), or None."""
    B, L = tokens.shape
    x = params["embed"][tokens.reshape(-1)]                                      # [B*L, D]
    if x.dtype == storage.PACKED_BF16:
        x = storage.load(x)
    positions = jnp.tile(jnp.arange(L, dtype=jnp.int32), B)
    cos, sin = cos_sin(positions, params["rope_inv_freq"])
    layers = params["layers"]
    if isinstance(layers, dict):  # stacked over layers (the engine's scanned layout)
        layers = [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(cfg.num_layers)]
    for i, lp in enumerate(layers):
        x = _layer(cfg, x, lp, cos, sin, B, L, lora, i)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps).reshape(B, L, -1)


def logits(cfg: ArchConfig, params: dict, tokens: jax.Array, lora: LoRAStep | None = None) -> jax.Array:
    """tokens [B, L] int -> float32 logits [B, L, V] (not jitted; see :func:`make_forward`)."""
    h = hidden_states(cfg, params, tokens, lora)
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    B, L, D = h.shape
    return matmul(h.reshape(B * L, D), w).reshape(B, L, -1)


def make_forward(cfg: ArchConfig):
    """``jax.jit``-ed ``forward(params, tokens [B, L], lora=None) -> logits [B, L, V]`` for one
    architecture; ``lora`` a :class:`~jaxllm.lora.apply.LoRAStep` (jaxllm/lora/train.py builds one)."""
    if cfg.architecture in FAMILY_B:
        raise ModelLoadError(f"jaxllm.functional does not implement {cfg.architecture} (its norms, rotary and "
                             "multipliers differ from Llama's); serve it with jaxllm.LLM")
    def forward(params, tokens, lora=None):
        return logits(cfg, params, jnp.asarray(tokens, jnp.int32), lora)

    fwd = jax.jit(forward)
    fwd.arch = cfg
    return fwd


def load(model: str | None = None, dtype: str = "float32"):
    """Loads a checkpoint (an HF folder, a .gguf, or None for the built-in model) to device arrays.

    Returns ``(params, forward)``; ``forward(params, tokens)`` takes int32 ``[B, L]`` token ids
    and returns float32 logits ``[B, L, V]``.  ``dtype``: "float32" or "bfloat16" (on CPU bf16
    matrices are kept as their uint16 bit patterns and activations stay float32, as in the
    engine).  A quantized GGUF is dequantized (the plain arrays this module computes with)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    loaded = load_model(model, dequantize=gguf_file(model) is not None)
    packed = dtype == "bfloat16" and jax.default_backend() == "cpu"
    params = to_device_params(loaded, jnp.dtype(dtype), scan_layers=False, packed_bf16=packed)
    forward = make_forward(loaded.arch)
    forward.name = loaded.name
    return params, forward

"""Qwen3-Next and Qwen3.5 (text) hybrid decoders as pure functions, after transformers'
``modeling_qwen3_next`` / ``modeling_qwen3_5`` / ``modeling_qwen3_5_moe``.

Architectures: ``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``.
A pre-norm decoder whose layers are of two kinds (``layer_types``):

* ``linear_attention``: a Gated DeltaNet layer.  The input is projected to q, k, v (the conv
  channels), z (the output gate) and b, a (write strength and decay); q/k/v pass the short
  causal conv (``layers/short_conv.py``), then the gated delta rule
  (``layers/gated_delta.py``) with ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a +
  dt_bias)``; its output is RMS-normed per value head, multiplied by ``silu(z)``, projected
  out.  Qwen3-Next stores the projections fused and interleaved by key-head group
  (``in_proj_qkvz`` / ``in_proj_ba``: per group q, k, then the group's v and z heads), Qwen3.5
  as four plain matrices (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).
  State per sequence and layer: the conv state ``[K - 1, C]`` and the delta-rule state
  ``[Hv, Dk, Dv]``; nothing grows with the sequence.
* ``full_attention``: GQA attention with per-head q/k RMSNorm, partial rotary (the first
  ``partial_rotary_factor`` of each head), and an output gate: ``q_proj`` gives each head its
  query and a gate, the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``.

The MLP is dense SwiGLU or a sparse MoE (softmax top-k, renormalised) plus a shared expert
scaled by ``sigmoid(shared_expert_gate(x))``.  Every RMSNorm except the GDN output norm is
zero-centred: it multiplies by ``1 + weight``.  Qwen3.5's multimodal RoPE (``mrope_section``)
is plain RoPE for text (all three position streams equal); with images, :func:`forward` takes
the image rows and the (t, h, w) positions models/qwen3_5_vl/ computes.

The engine serves them (the registry's entry; :func:`forward`, :func:`compute_logits`,
:func:`cache_kinds`, :func:`allocate_cache` at the end of this module): the full-attention
layers cache K/V pages (``layers/attention.attend``, every backend), each GDN layer keeps its
conv and delta-rule states in slots, one per sequence the KV budget seats (a per-sequence
cache kind of :meth:`HybridConfig.state_bytes`, ``max_num_seqs`` clamped to the slots),
owned by request id (``runner/state_slots.py``).  The conv runs on the flat ragged tokens
(:func:`conv_ragged_on_slots`: each sequence's conv state gathered and scattered back, or on
the CPU's native kernels updated in place) and the delta rule, in
every step, decodes too, as one loop over chunk-sized segments of each sequence
(:func:`segmented_gated_delta_rule`: C token slots a segment, a one-token segment the
recurrent update; not the S * T of rows of ``[S, T]``) that reads and writes the sequences'
slots in place.  With the Pallas decode kernel, and at tensor parallelism (rows ``[S, T]``),
a step gathers each sequence's slot before the layer, runs a decode step in the recurrent
form and a prefill step chunked, and scatters the rows back after.  A sequence whose first
token is at position 0 starts from zeros: a new request, or one recomputed after preemption.  Prefix caching is off
for these models and speculative decoding refused (``engine/core.py``).  Tensor parallelism
splits the GDN layers by key-head group: the conv channels are kept grouped by key head
(:func:`grouped_channels`, applied to the checkpoint's rows at load), so a device's slice of
the projections, the conv, the states and the output projection's columns are its own heads'
and only the output projection's all-reduce joins them.

The dense-batch reference harness the model tests run against transformers lives in
tests/support/qwen3_next_dense.py.
"""


from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.core.kv_budget import CacheKind
from jaxllm.layers import kv_quant
from jaxllm.layers.attention import attend
from jaxllm.layers.gated_delta import (chunk_gated_delta_rule, recurrent_gated_delta_rule, segmented_gated_delta_rule,
                                       segments)
from jaxllm.layers.linear import embed, linear, matmul
from jaxllm.layers.moe import moe_mlp
from jaxllm.layers.norm import rms_norm
from jaxllm.layers.rotary import apply_rope, cos_sin, mrope_axes, mrope_cos_sin
from jaxllm.layers.short_conv import conv_prefill, conv_prefill_ragged, conv_ragged_on_slots, conv_step
from jaxllm.models.kernels import Kernels
from jaxllm.models.qwen3_next.config import HybridArch, HybridConfig, num_full_layers, num_gdn_layers
from jaxllm.pallas.gated_delta import recurrent_gated_delta_rule_pallas
from jaxllm.parallel.mesh import TP, tp_size
from jaxllm.parallel.sharding import KV_AXES, cache_array


def _norm(x, w, eps):
    """The zero-centred RMSNorm: weight ``1 + w``."""
    return rms_norm(x, 1.0 + w.astype(jnp.float32), eps)


def _gdn_projections(cfg: HybridConfig, h, lp, mm: str = "xla"):
    """h [N, D] -> mixed [N, C] (per key head: its q, k and its group's v heads; see
    :func:`grouped_channels`), z [N, Hv, Dv], b, a [N, Hv] (``mm``: the linear backend)."""
    N = h.shape[0]
    Hk, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    r = Hv // Hk
    if cfg.fused_projections:
        # Per key-head group: q [Dk], k [Dk], the group's r v heads, its r z heads; then [b (r), a (r)].
        qkvz = linear(h, lp["in_qkvz"], backend=mm).reshape(N, Hk, 2 * Dk + 2 * r * Dv)
        q, k, v, z = jnp.split(qkvz, [Dk, 2 * Dk, 2 * Dk + r * Dv], axis=-1)
        b, a = jnp.split(linear(h, lp["in_ba"], backend=mm).reshape(N, Hk, 2 * r), 2, axis=-1)
        mixed = jnp.concatenate([q, k, v], axis=-1).reshape(N, -1)
        return mixed, z.reshape(N, Hv, Dv), b.reshape(N, Hv), a.reshape(N, Hv)
    mixed = linear(h, lp["in_qkv"], backend=mm)
    return (mixed, linear(h, lp["in_z"], backend=mm).reshape(N, Hv, Dv), linear(h, lp["in_b"], backend=mm),
            linear(h, lp["in_a"], backend=mm))


def _rule_inputs(cfg: HybridConfig, lp, mixed, b, a):
    """The delta rule's inputs from the conv's output: mixed [..., C], b, a [..., Hv] -> q, k
    [..., Hk, Dk], v [..., Hv, Dv], g (log decay), beta [..., Hv]."""
    Hk, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    lead = mixed.shape[:-1]
    q, k, v = jnp.split(mixed.reshape(*lead, Hk, -1), [Dk, 2 * Dk], axis=-1)   # per key head: q, k, its v heads
    v = v.reshape(*lead, Hv, Dv)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = (-jnp.exp(lp["A_log"].astype(jnp.float32))
         * jax.nn.softplus(a.astype(jnp.float32) + lp["dt_bias"].astype(jnp.float32)))
    return q, k, v, g, beta


def _gdn_mix(cfg: HybridConfig, lp, mixed, b, a, state, length, *, chunk_size: int, decode: str):
    """The conv and the gated delta rule of rows of tokens: mixed [B, T, C], b, a [B, T, Hv],
    state (conv, delta), length [B] or None -> (o [B, T, Hv, Dv] float32, state)."""
    B, T = mixed.shape[:2]
    conv_state, delta_state = state
    w = lp["conv"][:, 0, :]                                            # [C, K]
    if T == 1:
        y, conv_state = conv_step(mixed[:, 0], w, conv_state)
        mixed = y[:, None]
    else:
        mixed, conv_state = conv_prefill(mixed, w, conv_state, length)
    q, k, v, g, beta = _rule_inputs(cfg, lp, mixed, b, a)
    if T == 1:
        rule = _pallas_decode if decode == "pallas" else recurrent_gated_delta_rule
        o, delta_state = rule(q, k, v, g, beta, delta_state)
    else:
        o, delta_state = chunk_gated_delta_rule(q, k, v, g, beta, delta_state, length, chunk_size=chunk_size)
    return o, (conv_state, delta_state)


def _pallas_decode(q, k, v, g, beta, state):
    """The Pallas recurrent kernel; under tensor parallelism each device runs it on its own
    heads (the kernel is opaque to XLA's partitioner): q, k [B, 1, Hk, Dk], v [B, 1, Hv, Dv],
    g, beta [B, 1, Hv], state [B, Hv, Dk, Dv] -> (o [B, 1, Hv, Dv], state)."""
    if tp_size() == 1:
        return recurrent_gated_delta_rule_pallas(q, k, v, g, beta, state)
    heads, gates, st = P(None, None, TP, None), P(None, None, TP), P(None, TP, None, None)
    return jax.shard_map(recurrent_gated_delta_rule_pallas, in_specs=(heads, heads, heads, gates, gates, st),
                         out_specs=(heads, st), check_vma=False)(q, k, v, g, beta, state)


def _gdn_out(cfg: HybridConfig, lp, o, z, dtype, mm: str = "xla"):
    """The gated RMSNorm per value head, norm(o) * weight * silu(z), and the output
    projection: o, z [N, Hv, Dv] -> [N, D]."""
    o = rms_norm(o, lp["gdn_norm"].astype(jnp.float32), cfg.rms_norm_eps)
    o = o * jax.nn.silu(z.astype(jnp.float32))
    return linear(o.reshape(o.shape[0], cfg.value_dim).astype(dtype), lp["out"], backend=mm)


def mlp(cfg: HybridConfig, h, lp, mm: str = "xla", moe: str = "grouped", num_tokens=None):
    """h [N, D] -> [N, D]: dense SwiGLU, or the routed experts plus the gated shared expert
    (``mm``: the linear backend, ``moe``: the experts' implementation)."""
    if "router" not in lp:
        return linear(jax.nn.silu(linear(h, lp["gate"], backend=mm)) * linear(h, lp["up"], backend=mm), lp["down"],
                      backend=mm)
    y = moe_mlp(h, lp["router"], lp["experts_gate"], lp["experts_up"], lp["experts_down"],
                cfg.num_experts_per_tok, cfg.norm_topk_prob, moe, num_tokens=num_tokens)
    shared = linear(jax.nn.silu(linear(h, lp["shared_gate"], backend=mm)) * linear(h, lp["shared_up"], backend=mm),
                    lp["shared_down"], backend=mm)
    return y + jax.nn.sigmoid(matmul(h, lp["shared_expert_gate"])).astype(h.dtype) * shared


# ----------------------------------------------------------------------------- the engine

PER_SEQUENCE_STATE = True
"""This family keeps state per sequence (the GDN layers' recurrent state): the runner gives
each request a state slot by request id (runner/state_slots.py) and passes the step's slots
to :func:`forward`; prefix caching is off and speculative decoding refused (engine/core.py)."""

CHUNK_SIZE = 64
"""The chunked gated delta rule's chunk in the engine's prefill (transformers' too)."""

_XLA = Kernels()


def cache_kinds(arch: HybridArch, itemsize: int, kv_cache_dtype: str = "auto"):
    """K/V pages in each full-attention layer, a recurrent state (conv + delta rule, float32)
    per sequence in each GDN layer (core/kv_budget.py)."""
    if kv_cache_dtype != "auto":
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} is not supported for {arch.architecture} "
                         "(its full-attention layers' cache is kept in the model dtype); use --kv-cache-dtype auto")
    h = arch.hybrid
    return (CacheKind("K/V", num_full_layers(h), token_bytes=2 * h.num_kv_heads * h.head_dim * itemsize),
            CacheKind("recurrent state", num_gdn_layers(h), seq_bytes=h.state_bytes(4) // num_gdn_layers(h)))


def allocate_cache(arch: HybridArch, num_blocks: int, block_size: int, dtype, stacked: bool, make=jnp.zeros,
                   num_seqs: int = 1, sharding=None):
    """Zeroed ``(K pages, V pages, conv states, delta states)``: per full-attention layer K and
    V ``[num_blocks, block_size, Hkv, Dh]``, per GDN layer ``[num_seqs, K - 1, C]`` and
    ``[num_seqs, Hv, Dk, Dv]`` float32, one slot per sequence the budget seats (padding
    sequences read zeros and write nothing: no scratch slot beyond the budget).
    ``make=jax.ShapeDtypeStruct`` gives the shapes without allocating; ``sharding``: logical
    axes -> the array's sharding (parallel/sharding.py): the pages split by KV head, the
    states by key-head group (C, grouped by :func:`grouped_channels`) and value head."""
    h = arch.hybrid
    if stacked:
        raise ValueError(f"{arch.architecture}: its GDN and full-attention layers differ and cannot run under "
                         "lax.scan; use --no-scan-layers")
    if isinstance(dtype, kv_quant.KVFormat):   # refused earlier by cache_kinds, named by its flag
        raise ValueError(f"{arch.architecture}: a quantized KV cache is not supported; "  # noqa: TRY004
                         "use --kv-cache-dtype auto")
    new = partial(cache_array, make, sharding)
    page = (num_blocks, block_size, h.num_kv_heads, h.head_dim)
    n_full, n_gdn = num_full_layers(h), num_gdn_layers(h)
    conv = (num_seqs, h.conv_kernel - 1, h.conv_dim)
    delta = (num_seqs, h.linear_num_value_heads, h.linear_key_head_dim, h.linear_value_head_dim)
    conv_axes, delta_axes = ("state_slots", None, "gdn_heads"), ("state_slots", "gdn_value_heads", None, None)
    return ([new(page, dtype, KV_AXES) for _ in range(n_full)], [new(page, dtype, KV_AXES) for _ in range(n_full)],
            [new(conv, jnp.float32, conv_axes) for _ in range(n_gdn)],
            [new(delta, jnp.float32, delta_axes) for _ in range(n_gdn)])


def _paged_attention(cfg: HybridConfig, h, lp, kv, md, cos, sin, kernels: Kernels):
    """The gated full attention over the paged cache: h [T, D] (normed) -> ([T, D], (K, V))."""
    T = h.shape[0]
    H, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    mm = kernels.linear
    qg = linear(h, lp["q"], backend=mm).reshape(T, H, 2 * Dh)
    q, gate = qg[..., :Dh], qg[..., Dh:].reshape(T, H * Dh)           # each head: query, then its gate
    q = apply_rope(_norm(q, lp["q_norm"], cfg.rms_norm_eps), cos, sin)
    k = _norm(linear(h, lp["k"], backend=mm).reshape(T, Hkv, Dh), lp["k_norm"], cfg.rms_norm_eps)
    k = apply_rope(k, cos, sin)
    v = linear(h, lp["v"], backend=mm).reshape(T, Hkv, Dh)
    o, kv = attend(q.astype(h.dtype), k.astype(h.dtype), v.astype(h.dtype), kv, None, md, scale=Dh ** -0.5,
                   sliding_window=None, backend=kernels.attention)      # [T, H, Dh]
    o = o.reshape(T, H * Dh).astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))
    return linear(o.astype(h.dtype), lp["o"], backend=mm), kv


def _ragged_gdn(cfg: HybridConfig, h, lp, conv_all, delta_all, slots, md, kernels: Kernels):
    """A GDN layer over the step's flat ragged tokens: h [T, D] (normed); conv_all, delta_all
    the layer's states of every slot; slots [S] each sequence's slot (out of range: a padding
    sequence, which reads zeros and writes nothing) -> ([T, D], conv_all, delta_all).

    The projections and the conv run on the flat tokens, the delta rule on chunk-sized
    segments of each sequence (``layers/gated_delta.segments``) on the slots in place; with
    the Pallas decode kernel on gathered rows, and at tensor parallelism on rows ``[S, T]``,
    a decode step (no sequence of more than one token) in the recurrent form on ``[S, 1]``.
    A sequence whose first token this step is at position 0 starts from a zeroed state (a new
    request, or one recomputed after preemption: prefix caching is off)."""
    T = h.shape[0]
    Hv, Dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    mixed, z, b, a = _gdn_projections(cfg, h, lp, kernels.linear)      # [T, C], [T, Hv, Dv], [T, Hv]
    mixed = mixed.astype(jnp.float32)
    qsl = md.query_start_loc                                          # [S + 1]
    start, length = qsl[:-1], qsl[1:] - qsl[:-1]                      # [S]
    fresh = md.positions[jnp.clip(start, 0, T - 1)] == 0               # [S]
    decode = "pallas" if kernels.attention == "pallas" else "xla"
    # The CPU's native kernels (picked with its attention) also take the conv and the decodes'
    # delta updates, on the slots in place.
    on_slots = "native" if kernels.attention == "native" else "xla"

    def gathered(all_states):
        # [slots, ...] -> each sequence's rows [S, ...], zeros for a fresh or a padding one
        rows = jnp.take(all_states, slots, axis=0, mode="fill", fill_value=0)
        return jnp.where(fresh.reshape((-1,) + (1,) * (rows.ndim - 1)), 0.0, rows)

    def rule(y, b, a, states, rows):
        # The delta rule over the step's segments on ``states``, sequence s's in row rows[s]
        # -> (o [T, Hv, Dv], states).
        q, k, v, g, beta = _rule_inputs(cfg, lp, y, b, a)                # [T, H, D] / [T, Hv]
        seq, *seg, used = segments(qsl, T, CHUNK_SIZE)                   # [N]
        return segmented_gated_delta_rule(q, k, v, g, beta, states, rows[seq], *seg, used, fresh[seq],
                                          chunk_size=CHUNK_SIZE, backend=on_slots)   # [T, Hv, Dv]

    if tp_size() == 1 and decode == "xla":
        # Every step, decode or prefill, one loop over its segments that reads and writes the
        # sequences' slots in place (a one-token segment the recurrent update; with the CPU's
        # kernels all of them in one call first): no gathered copy of the states, no cond
        # (whose branches cannot update the slot arrays in place).  A padding sequence has no
        # segment: its out-of-range slot is never read.  The conv the same, on its slots.
        y, conv_all = conv_ragged_on_slots(mixed, lp["conv"][:, 0, :], conv_all, slots, start, length, fresh,
                                           md.token_seq, backend=on_slots)   # [T, C]
        o, delta_all = rule(y, b, a, delta_all, slots)
        return _gdn_out(cfg, lp, o.reshape(T, Hv, Dv), z, h.dtype, kernels.linear), conv_all, delta_all

    def prefill_rows(mixed, b, a, conv_all, delta_all):
        # Tensor parallelism: the tokens regrouped into rows [S, T] (S * T token slots of work).
        # The segmented form below hung the tp=2 engine on simulated CPU devices (cause not
        # found yet), so sharded steps keep this form.
        rows = jnp.clip(start[:, None] + jnp.arange(T)[None, :], 0, T - 1)   # [S, T] flat index of (s, j)
        o, st = _gdn_mix(cfg, lp, mixed[rows], b[rows], a[rows], (gathered(conv_all), gathered(delta_all)),
                         length, chunk_size=CHUNK_SIZE, decode=decode)   # [S, T, Hv, Dv]
        j = jnp.clip(jnp.arange(T) - start[md.token_seq], 0, T - 1)     # [T] each token's index in its row
        return o[md.token_seq, j], st

    def prefill(mixed, b, a, conv_all, delta_all):
        # With the Pallas decode kernel: as above, on the sequences' gathered rows.
        y, conv1 = conv_prefill_ragged(mixed, lp["conv"][:, 0, :], gathered(conv_all), start, length,
                                       md.token_seq)                     # [T, C]
        o, delta1 = rule(y, b, a, gathered(delta_all), jnp.arange(start.shape[0]))
        return o, (conv1, delta1)

    def one_token(mixed, b, a, conv_all, delta_all):
        first = jnp.clip(start, 0, T - 1)                              # [S] each sequence's token
        o, st = _gdn_mix(cfg, lp, mixed[first][:, None], b[first][:, None], a[first][:, None],
                         (gathered(conv_all), gathered(delta_all)), None, chunk_size=CHUNK_SIZE,
                         decode=decode)                                  # [S, 1, Hv, Dv]
        return o[md.token_seq, 0], st

    # The branches read the slot arrays and give each sequence's new rows [S, ...], written
    # back after the cond: a cond that returned the slot arrays copied them whole (every slot,
    # twice a step), and rows gathered before it were copied again by a loop that updated them.
    o, (conv1, delta1) = jax.lax.cond(jnp.max(length) <= 1, one_token, prefill if tp_size() == 1 else prefill_rows,
                                      mixed, b, a, conv_all, delta_all)
    conv_all = conv_all.at[slots].set(conv1.astype(conv_all.dtype), mode="drop")
    delta_all = delta_all.at[slots].set(delta1.astype(delta_all.dtype), mode="drop")
    return _gdn_out(cfg, lp, o.reshape(T, Hv, Dv), z, h.dtype, kernels.linear), conv_all, delta_all


def forward(arch: HybridArch, params: dict, kv, input_ids: jax.Array, md, kernels: Kernels = _XLA,
                   state_slots: jax.Array | None = None, image_rows: tuple[jax.Array, jax.Array] | None = None,
                   rope_positions: jax.Array | None = None):
    """The engine's forward over one ragged step: input_ids [T], md (layers/attention.py's
    AttentionMetadata), kv :func:`allocate_cache`'s pytree, state_slots [S] each sequence's
    state slot (None: sequence s in slot s) -> final hidden states [T, D] and the cache.
    With images (Qwen3.5, models/qwen3_5_vl/): ``image_rows`` (row [T] int32, -1 for a text
    token; embeds [N, D]): a token with a row takes that image embedding instead of its token
    embedding; ``rope_positions`` [3, T]: the M-RoPE (t, h, w) positions the rotary turns by
    (``md.positions`` stays the sequence index: the cache slots and the causal mask)."""
    cfg = arch.hybrid
    native = kernels.matmul == "native"
    x = embed(params["embed"], input_ids, panels=native and cfg.tie_word_embeddings)   # [T, D]
    if native:
        x = x.astype(jnp.float32)
    if image_rows is not None:
        row, embeds = image_rows
        picked = embeds.astype(x.dtype)[jnp.maximum(row, 0)]            # [T, D]
        x = jnp.where((row >= 0)[:, None], picked, x)
    if rope_positions is None:
        cos, sin = cos_sin(md.positions, params["rope_inv_freq"])        # [T, R/2]
    else:
        if len(cfg.mrope_section) != 3:
            raise ValueError(f"{cfg.architecture}: rope_positions need rope_parameters.mrope_section "
                             f"(three sections), the config has {list(cfg.mrope_section)}")
        cos, sin = mrope_cos_sin(rope_positions, params["rope_inv_freq"],
                                 mrope_axes(cfg.rotary_dim, cfg.mrope_section))
    S = md.query_start_loc.shape[0] - 1
    slots = jnp.arange(S, dtype=jnp.int32) if state_slots is None else state_slots
    ks, vs, convs, deltas = (list(c) for c in kv)
    fi = gi = 0
    for i, lp in enumerate(params["layers"]):
        h = _norm(x, lp["input_norm"], cfg.rms_norm_eps)
        if cfg.is_linear(i):
            y, convs[gi], deltas[gi] = _ragged_gdn(cfg, h, lp, convs[gi], deltas[gi], slots, md, kernels)
            gi += 1
        else:
            y, (ks[fi], vs[fi]) = _paged_attention(cfg, h, lp, (ks[fi], vs[fi]), md, cos, sin, kernels)
            fi += 1
        x = x + y.astype(x.dtype)
        h = _norm(x, lp["post_norm"], cfg.rms_norm_eps).astype(x.dtype)
        x = x + mlp(cfg, h, lp, kernels.linear, kernels.moe, md.query_start_loc[-1]).astype(x.dtype)
    return _norm(x, params["final_norm"], cfg.rms_norm_eps), (ks, vs, convs, deltas)


def compute_logits(arch: HybridArch, params: dict, hidden: jax.Array, kernels: Kernels = _XLA) -> jax.Array:
    """hidden [S, D] -> float32 logits [S, V]."""
    w = params["embed"] if arch.tie_word_embeddings else params["lm_head"]
    return matmul(hidden, w, kernels.linear)

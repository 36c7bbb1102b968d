"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral): top-k routing and SwiGLU experts.

Routing follows transformers' ``Qwen3MoeTopKRouter`` / ``MixtralTopKRouter`` exactly:
router logits ``x @ router.T``, a softmax over all experts in float32, the top-k
probabilities and their experts (``lax.top_k``: ties to the lower index), renormalised to sum to one when
the checkpoint says so (Qwen3-MoE's ``norm_topk_prob``; Mixtral always).  Each token's
output is ``sum_j weight_j * down_e(silu(gate_e(x)) * up_e(x))`` over its k experts.

Two implementations of the experts, same function:

``impl="grouped"`` (the engine's): the ``T*k`` (token, expert) assignments are sorted by
expert; a loop runs over the experts that received at least one token, slices that expert's
three matrices once, and runs its rows in blocks of ``B`` (a matrix-vector product per row at
decode sizes); results are unsorted and combined with the routing weights.  Only routed
experts' weights are read: at decode, k of E experts per token.  Padding tokens (at or past
``num_tokens``) are routed nowhere.  With ``layer`` given, the expert weights are the
whole stacks ``[L, E, ...]`` and one ``dynamic_slice`` takes ``[layer, e]``: under
``lax.scan``, a scanned-in ``[E, F, D]`` slice would be copied out of the stack in full
before the loop reads two experts of it (XLA:CPU, ``bench/moe.py --scan``: 127 ms instead of
13.5 ms per batch-1 step of six layers of 32 experts).

``impl="expert_parallel"`` (``--enable-expert-parallel``): the grouped experts with the
expert axis split over the ``tp`` mesh axis inside ``shard_map``: each device runs only the
assignments routed to its own experts and a psum joins them (without a tensor-parallel mesh,
the same as grouped).

``impl="dense"``: every expert on every token, ``einsum`` over the expert axis, combined with
routing weights that are zero for unrouted experts: E/k times the work.  The baseline of
``bench/moe.py`` and an oracle in the tests.

Not used: ``jax.lax.ragged_dot``.  On XLA:CPU (jax 0.10.2) it lowers to a dense dot whose
contraction runs over all groups (``x`` masked to ``[M, E*D]`` by a select, the weights
copied to ``[E*D, F]``): E times the FLOPs of the routed work plus a full weight copy, slower
than even the dense einsum (``bench/moe.py --block``: one block of 32 experts at T=1,
~105 ms vs ~9 ms dense and ~1 ms grouped).

Weights keep transformers' ``[out, in]`` layout: gate/up ``[E, F, D]``, down ``[E, D, F]``,
router ``[E, D]``; float32 or packed bf16 (``formats/storage.py``: only the sliced expert is
bit-cast, and dots accumulate in float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.formats.storage import PACKED_BF16
from jaxllm.layers.linear import matmul
from jaxllm.parallel.mesh import TP, tp_size

IMPLS = ("grouped", "dense", "expert_parallel")


@dataclass(frozen=True)
class Routing:
    """How a router turns logits into experts, beyond top-k and renormalisation.

    ``scoring="sigmoid"`` is GLM-4-MoE's (transformers' ``Glm4MoeTopkRouter``): scores are
    ``sigmoid(logits)``; experts are chosen by ``scores + bias`` (the checkpoint's
    ``e_score_correction_bias``), first among the ``topk_group`` best of ``n_group`` equal
    groups (a group's merit: the sum of its two best), then the top k of those; the weights
    are the chosen experts' unbiased scores (renormalised with a 1e-20 guard when asked),
    times ``scale`` (``routed_scaling_factor``)."""

    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0

    @staticmethod
    def of(arch) -> Routing:
        return Routing(arch.moe.router_scoring, arch.moe.n_group, arch.moe.topk_group, arch.moe.routed_scaling_factor)


def _route_sigmoid(logits, bias, top_k: int, renormalize: bool, routing: Routing):
    # logits [T, E] float32, bias [E] -> weights [T, k], experts [T, k]
    T, E = logits.shape
    scores = jax.nn.sigmoid(logits)                                 # [T, E]
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if routing.n_group > 1:
        G = routing.n_group
        grouped = choice.reshape(T, G, E // G)                      # [T, G, E/G]
        merit = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)          # [T, G]
        best = jax.lax.top_k(merit, routing.topk_group)[1]          # [T, topk_group]
        keep = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], best].set(True)   # [T, G]
        choice = jnp.where(jnp.repeat(keep, E // G, axis=1), choice, -jnp.inf)
    experts = jax.lax.top_k(choice, top_k)[1]                       # [T, k]
    weights = jnp.take_along_axis(scores, experts, axis=1)          # [T, k]
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * jnp.float32(routing.scale), experts.astype(jnp.int32)


def route(x: jax.Array, router: jax.Array, top_k: int, renormalize: bool, routing: Routing = Routing(),
          bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [T, D], router [E, D] -> (weights [T, k] float32, experts [T, k] int32)."""
    logits = matmul(x, router)                                     # [T, E] float32
    if routing.scoring == "sigmoid":
        return _route_sigmoid(logits, bias, top_k, renormalize, routing)
    if routing.scoring != "softmax":
        raise ValueError(f"router scoring must be softmax or sigmoid, got {routing.scoring!r}")
    probs = jax.nn.softmax(logits, axis=-1)                         # [T, E]
    weights, experts = jax.lax.top_k(probs, top_k)                  # [T, k], [T, k]
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _block_rows(n: int, num_experts: int) -> int:
    """Rows per expert matmul in the grouped loop.  XLA:CPU runs a 1-row dot as a fast
    matrix-vector product and small-M GEMMs poorly: one row at a time until experts get
    ~8 rows on average, then blocks of about the average group (at most 64)."""
    avg = n // num_experts
    if avg < 8:
        return 1
    return min(64, 1 << (avg.bit_length() - 1))


def _expert(w: jax.Array, layer, e) -> jax.Array:
    """One expert's array: w[e] (w [E, ...]) or w[layer, e] (w [L, E, ...]): a matrix, or a
    bias vector (GPT-OSS)."""
    if layer is None:
        return jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False)
    rest = w.shape[2:]
    return jax.lax.dynamic_slice(w, (layer, e) + (0,) * len(rest), (1, 1, *rest)).reshape(rest)


def _swiglu_expert(x, g, u, d):
    # x [B, D], g/u [F, D], d [D, F] -> float32 [B, D]
    h = jax.nn.silu(matmul(x, g)) * matmul(x, u)                   # [B, F]
    return matmul(h.astype(x.dtype), d)


def _grouped(x, weights, experts, mats, layer, num_tokens, expert_fn=_swiglu_expert):
    """``mats``: the expert stacks ``[(L,) E, ...]`` (the first a matrix), sliced per expert and
    passed to ``expert_fn(x [B, D], *slices) -> float32 [B, D]``."""
    T, D = x.shape
    k = experts.shape[1]
    E = mats[0].shape[-3]
    N = T * k
    flat = experts.reshape(N)                                      # [N] expert of each (token, slot)
    if num_tokens is not None:
        # Padding tokens get the sentinel expert E: sorted last, counted nowhere.
        valid = jnp.arange(N, dtype=jnp.int32) // k < num_tokens  # [N]
        flat = jnp.where(valid, flat, E)
    order = jnp.argsort(flat, stable=True)                         # [N] assignments sorted by expert
    B = _block_rows(N, E)
    xs = jnp.concatenate([x[order // k], jnp.zeros((B, D), x.dtype)])  # [N + B, D]
    counts = jnp.zeros((E + 1,), jnp.int32).at[flat].add(1)[:E]    # [E] rows per expert
    starts = jnp.cumsum(counts) - counts                            # [E] first sorted row of each expert
    hit = jnp.nonzero(counts, size=min(E, N), fill_value=0)[0].astype(jnp.int32)  # experts with rows, ascending
    n_hit = jnp.count_nonzero(counts)

    def per_expert(i, y):
        e = hit[i]
        ws = [_expert(w, layer, e) for w in mats]
        start = starts[e]

        def per_block(j, y):
            # Blocks go forward and experts ascend, so the rows a last, partial block spills
            # into belong to a later expert (rewritten when its turn comes) or to the tail.
            r = start + j * B
            xb = jax.lax.dynamic_slice_in_dim(xs, r, B)            # [B, D]
            return jax.lax.dynamic_update_slice_in_dim(y, expert_fn(xb, *ws), r, 0)

        return jax.lax.fori_loop(0, (counts[e] + B - 1) // B, per_block, y)

    y = jax.lax.fori_loop(0, n_hit, per_expert, jnp.zeros((N + B, D), jnp.float32))[:N]  # [N, D] sorted
    y = y[jnp.argsort(order)].reshape(T, k, D)                     # [T, k, D] back in (token, slot) order
    if num_tokens is not None:
        weights = jnp.where(jnp.arange(T)[:, None] < num_tokens, weights, 0.0)
    return jnp.sum(y * weights[..., None], axis=1)                  # [T, D]


def _dense(x, weights, experts, w_gate, w_up, w_down, layer):
    T = x.shape[0]
    E = w_gate.shape[-3]
    if layer is not None:
        w_gate, w_up, w_down = (jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)
                                for w in (w_gate, w_up, w_down))
    if w_gate.dtype == PACKED_BF16:
        w_gate, w_up, w_down = (jax.lax.bitcast_convert_type(w, jnp.bfloat16) for w in (w_gate, w_up, w_down))
    xc = x.astype(w_gate.dtype)
    combine = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], experts].set(weights)  # [T, E]
    g = jnp.einsum("td,efd->etf", xc, w_gate, preferred_element_type=jnp.float32)      # [E, T, F]
    u = jnp.einsum("td,efd->etf", xc, w_up, preferred_element_type=jnp.float32)        # [E, T, F]
    h = (jax.nn.silu(g) * u).astype(x.dtype).astype(w_down.dtype)                       # [E, T, F]
    y = jnp.einsum("etf,edf->etd", h, w_down, preferred_element_type=jnp.float32)      # [E, T, D]
    return jnp.einsum("te,etd->td", combine, y)                                         # [T, D]


def _expert_parallel(x, weights, experts, mats, layer, num_tokens, expert_fn=_swiglu_expert):
    """The grouped experts with the expert axis split over the ``tp`` mesh axis: every device
    holds E/tp experts and computes, for all tokens (activations are replicated), only the
    assignments routed to its own experts; one psum adds the devices' partial outputs.  No
    device reads another's expert weights (XLA's partitioner, left alone, would all-gather
    the whole expert stacks to slice one expert)."""
    stacked = layer is not None
    # [(L,) E, ...]: experts split
    w_specs = tuple(P(*([None] * stacked), TP, *([None] * (w.ndim - 1 - stacked))) for w in mats)
    extra = tuple(a for a in (layer, num_tokens) if a is not None)
    M = len(mats)

    def local(x, weights, experts, *rest):
        mats, extra = rest[:M], rest[M:]
        it = iter(extra)
        lyr = next(it) if stacked else None
        n = next(it) if num_tokens is not None else None
        E_local = mats[0].shape[-3]
        lo = jax.lax.axis_index(TP) * E_local
        mine = (experts >= lo) & (experts < lo + E_local)           # [T, k]
        # Assignments to other devices' experts get the sentinel E_local: never computed,
        # their rows stay zero.
        local_experts = jnp.where(mine, experts - lo, E_local)
        y = _grouped(x, weights, local_experts, mats, lyr, n, expert_fn)   # [T, D] partial
        return jax.lax.psum(y, TP)

    return jax.shard_map(local, in_specs=(P(), P(), P(), *w_specs, *(P() for _ in extra)),
                         out_specs=P(), check_vma=False)(x, weights, experts, *mats, *extra)


def moe_mlp(x: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
            top_k: int, renormalize: bool, impl: str = "grouped", *, layer=None,
            num_tokens=None, routing: Routing = Routing(), bias: jax.Array | None = None) -> jax.Array:
    """x [T, D] -> [T, D] (x's dtype): the sparse MoE block.

    router [E, D]; w_gate, w_up [E, F, D]; w_down [E, D, F] (or [L, E, ...] stacks with
    ``layer`` the index to use).  ``num_tokens`` (a traced scalar): rows at or past it are
    padding, their output is zero and they cost no expert work.  ``routing``, ``bias``
    [E]: see :class:`Routing`."""
    if impl not in IMPLS:
        raise ValueError(f"moe impl must be one of {IMPLS}, got {impl!r}")
    weights, experts = route(x, router, top_k, renormalize, routing, bias)   # [T, k], [T, k]
    if impl in ("grouped", "expert_parallel"):
        y = routed_experts(x, weights, experts, (w_gate, w_up, w_down), impl, layer=layer, num_tokens=num_tokens)
    else:
        if num_tokens is not None:
            weights = jnp.where(jnp.arange(x.shape[0])[:, None] < num_tokens, weights, 0.0)
        y = _dense(x, weights, experts, w_gate, w_up, w_down, layer)
    return y.astype(x.dtype)


def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, mats: tuple, impl: str = "grouped",
                   expert_fn=_swiglu_expert, *, layer=None, num_tokens=None) -> jax.Array:
    """The grouped experts (``impl`` "grouped", or "expert_parallel": split over the ``tp``
    mesh axis when there is one) for tokens already routed: x [T, D], weights / experts
    [T, k] -> float32 [T, D] = sum_j weights_j * expert_fn(x, *mats[experts_j]).  ``mats``:
    the expert stacks ``[(L,) E, ...]``, the first a matrix (for other families' experts:
    GPT-OSS's biases and clamped SwiGLU, ``models/gpt_oss/``)."""
    if impl == "expert_parallel" and tp_size() > 1:
        return _expert_parallel(x, weights, experts, mats, layer, num_tokens, expert_fn)
    return _grouped(x, weights, experts, mats, layer, num_tokens, expert_fn)

"""Truncation of the random rows: temperature, min_p, top-k, top-p, as one integer key per row.

A row keeps the entries of its temperature-scaled, min_p-masked logits ``x1`` whose
monotone integer key (``numerics.float_key``) is >= the row's ``tau``.  Top-k keeps every
entry >= the k-th largest value; top-p keeps every entry >= the value at which the
descending cumulative mass first reaches ``top_p`` of the total (vLLM's "smallest set with
mass >= top_p", ties at the threshold kept); equivalently an entry is kept iff the mass of
the entries strictly above it is below the target.  Masses are fixed-point integer sums of
``exp(x - m)`` (``numerics.limbs``), so no summation order can change a decision.

:func:`truncate` is the stage both draws call: it returns a :class:`Truncation`, whose
``tau`` is the whole key except for the ``open`` rows (a nucleus wider than the candidate
search can settle).  :func:`whole_key` settles those by the whole-row search: the Pallas
draw needs it up front; the XLA draw usually decides the open rows from its best-scoring
candidates without it (``draw.gumbel_argmax``) and calls it only as its fallback.

No full sort: the ``TRUNC_BLOCKS`` candidate blocks (``blocked.candidates``) hold every
value above the next block's maximum, and a bitwise search over the key (32 passes of an
exact count or mass) finds the threshold among them; a result above that bound is the
whole row's.  The sort-based baseline is ``reference.truncation_threshold_reference``.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.formats import numerics as nx
from jaxllm.sample.arrays import SamplingMetadata
from jaxllm.sample.blocked import CAND_BLOCK, NEG_INF, candidates, count_at_least

TRUNC_BLOCKS = 64
"""Blocks whose entries the top-k / top-p threshold search examines (1,024 per row)."""
NUM_CANDIDATES = TRUNC_BLOCKS * CAND_BLOCK


class Truncation(NamedTuple):
    """The truncation of one step's rows (computed for every row, meaningful for random ones)."""

    x1: jax.Array         # [S, V] f32 temperature-scaled logits, min_p applied, no -0.0
    m: jax.Array          # [S] f32 row maximum of x1 before min_p
    truncated: jax.Array  # [S] bool random rows with top-k or top-p
    tau: jax.Array        # [S] u32 keep float_key(x1) >= tau (open rows: top-k's key only)
    open: jax.Array       # [S] bool random rows whose top-p key is not in tau yet
    target: jax.Array     # [S] f32 the open rows' top-p mass (top_p * total)
    cands: tuple | None   # (values [S, C], indices [S, C], inside [S]) or None, see truncation_threshold


def scaled_logits(x: jax.Array, md: SamplingMetadata, is_random: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Temperature-scaled logits with min_p applied, and their row maximum before min_p:
    x [S, V] -> (x1 [S, V], m [S]).  Greedy rows are scaled by 1."""
    temp = jnp.where(is_random, md.temperature, 1.0)
    x1 = x / temp[:, None]
    x1 = jnp.where(x1 == 0.0, 0.0, x1)                                   # no -0.0 for the integer keys
    m = x1.max(axis=-1)                                                  # [S]
    return jnp.where(x1 - m[:, None] < md.log_min_p[:, None], NEG_INF, x1), m   # min_p


# ---------------------------------------------------------------- exact counts and masses

def search(pred, S: int) -> jax.Array:
    """Largest uint32 t with pred(t) [S] true, bit by bit from the top (pred monotone
    non-increasing in t, true at 0)."""
    def body(i, t):
        cand = t | (jnp.uint32(1) << (jnp.uint32(31) - i.astype(jnp.uint32)))
        return jnp.where(pred(cand), cand, t)
    return jax.lax.fori_loop(0, 32, body, jnp.zeros((S,), jnp.uint32))


def limbs(e: jax.Array) -> jax.Array:
    """e [S, N] -> [3, S, N] float32 fixed-point limbs (see numerics.limbs)."""
    return jnp.stack(nx.limbs(e))


def mass(limb3: jax.Array, keep: jax.Array) -> jax.Array:
    """Exact fixed-point mass of the kept entries, [3, S, N] limbs (float32 integers < 2^12),
    keep [S, N] -> [S] float32: summed in float32 over blocks of 16 (exact below 2^24), then
    as int32 (exact below 2^31), so no reduction order can change the result.  (A uint32
    reduce over [S, V] is several times slower than a float one on XLA:CPU.)"""
    part = jnp.where(keep[None], limb3, 0.0)                             # [3, S, N]
    L, S, N = part.shape
    pad = -N % CAND_BLOCK
    if pad:
        part = jnp.pad(part, ((0, 0), (0, 0), (0, pad)))
    part = part.reshape(L, S, -1, CAND_BLOCK).sum(axis=-1)               # [3, S, nb] exact
    sums = part.astype(jnp.int32).sum(axis=-1).astype(jnp.uint32)        # [3, S]
    return nx.combine(sums[0], sums[1], sums[2])


def _count_reaches(keys: jax.Array, k: jax.Array, t: jax.Array) -> jax.Array:
    """[S] bool: at least k [S] entries of keys [S, N] are >= t [S] (top-k's predicate)."""
    return count_at_least(keys, t) >= k


def _mass_reaches(limb3: jax.Array, keys: jax.Array, target: jax.Array, t: jax.Array,
                  kept: jax.Array | None = None) -> jax.Array:
    """[S] bool: the mass of the entries (of ``kept``) whose keys are >= t reaches target
    (top-p's predicate)."""
    keep = keys >= t[:, None]
    return mass(limb3, keep if kept is None else kept & keep) >= target


def kept_mass(x: jax.Array, tau: jax.Array, m: jax.Array, zero: jax.Array) -> jax.Array:
    """The mass of the entries of x [S, V] that tau [S] keeps: [S] float32."""
    kept = nx.float_key(x) >= tau[:, None]
    return mass(limbs(nx.exp_nonpos(jnp.where(kept, x, NEG_INF) - m[:, None], jnp, zero)), kept)


# ---------------------------------------------------------------- thresholds

def truncation_threshold(x: jax.Array, m: jax.Array, md: SamplingMetadata, zero: jax.Array):
    """Top-k then top-p over x [S, V] (temperature-scaled, min_p applied, no -0.0); m [S] the
    row maximum.  Returns ``(tau, open, target, cands)``: keep the entries whose ``float_key``
    >= tau [S] u32; for the rows where ``open`` [S] is set, tau is top-k's only and top-p is
    left to :func:`whole_key` or the draw, with ``target`` [S] its mass (top_p * total).
    ``cands``: the candidates' values and indices [S, C] and ``inside`` [S], set where every
    kept entry is among them (see ``draw.draw_candidates``).

    A bitwise search for the largest key whose count (top-k) or mass (top-p) still reaches
    the target, over the entries of the ``TRUNC_BLOCKS`` blocks with the largest maxima.
    Above ``outside`` (the largest maximum of the other blocks) those counts and masses are
    the whole row's, so a result above it is exact.  Otherwise top-k reruns the search over
    the whole row (32 passes of a count), and top-p is left open."""
    S, V = x.shape
    k_eff = jnp.where(md.top_k > 0, jnp.minimum(md.top_k, V), V)         # [S]
    u0 = jnp.uint32(0)
    cand, cidx, outside = candidates(x, TRUNC_BLOCKS)                    # [S, C], [S, C], [S]
    ckeys = nx.float_key(cand)
    out_key = nx.float_key(outside)
    tau_c = search(partial(_count_reaches, ckeys, k_eff), S)
    ok_k = (md.top_k <= 0) | (tau_c > out_key)
    tau_k = jnp.where(md.top_k > 0, tau_c, u0)

    def whole_row_top_k():
        # The whole row's keys only here: a value captured by a lax.cond branch is an
        # operand, computed whether or not the branch runs.
        keys = nx.float_key(x)                                           # [S, V] u32
        return jnp.where(ok_k, tau_k, search(partial(_count_reaches, keys, k_eff), S))

    tau_k = jax.lax.cond(jnp.any(~ok_k), whole_row_top_k, lambda: tau_k)

    def top_p():
        ckept = ckeys >= tau_k[:, None]
        climb3 = limbs(nx.exp_nonpos(jnp.where(ckept, cand, NEG_INF) - m[:, None], jnp, zero))
        # The total is the candidates' when every other entry is cut by top-k (or min_p): then
        # the whole-row exponential is skipped.
        inside = (md.top_p >= 1.0) | (out_key < tau_k) | (outside == NEG_INF)
        total = jax.lax.cond(jnp.all(inside), lambda: mass(climb3, ckept), lambda: kept_mass(x, tau_k, m, zero))
        target = md.top_p * total
        tau_c = search(partial(_mass_reaches, climb3, ckeys, target, kept=ckept), S)
        ok_p = (md.top_p >= 1.0) | (tau_c > out_key)
        tau_p = jnp.where(md.top_p < 1.0, tau_c, u0)
        return jnp.where(ok_p, jnp.maximum(tau_k, tau_p), tau_k), ~ok_p, target

    tau, open_p, target = jax.lax.cond(jnp.any(md.top_p < 1.0), top_p,
                                       lambda: (tau_k, jnp.zeros((S,), jnp.bool_), jnp.zeros((S,), jnp.float32)))
    # Every entry kept lies among the candidates when tau is above every other block's maximum.
    inside = ~open_p & ((tau > out_key) | (outside == NEG_INF))
    return tau, open_p, target, (cand, cidx, inside)


def topp_full_search(x: jax.Array, m: jax.Array, target: jax.Array, zero: jax.Array) -> jax.Array:
    """The top-p threshold key over whole rows ([S, V], already top-k masked): 32 passes of an
    exact mass.  The slow path, for a nucleus wider than every shortcut."""
    S = x.shape[0]
    k = nx.float_key(x)
    limb3 = limbs(nx.exp_nonpos(x - m[:, None], jnp, zero))
    return search(partial(_mass_reaches, limb3, k, target), S)


def _untruncated(S: int, with_candidates: bool):
    none = (jnp.zeros((S,), jnp.uint32), jnp.zeros((S,), jnp.bool_), jnp.zeros((S,), jnp.float32))
    if not with_candidates:
        return none
    return (*none, (jnp.zeros((S, NUM_CANDIDATES), jnp.float32), jnp.zeros((S, NUM_CANDIDATES), jnp.int32),
                    jnp.zeros((S,), jnp.bool_)))


def _thresholds(x1, m, md, zero, with_candidates: bool):
    out = truncation_threshold(x1, m, md, zero)
    return out if with_candidates else out[:3]


def truncate(x: jax.Array, md: SamplingMetadata, zero: jax.Array, is_random: jax.Array, *,
             keep_candidates: bool) -> Truncation:
    """The truncation stage: processed logits x [S, V] -> :class:`Truncation`.  The threshold
    search runs only when a random row truncates.  ``keep_candidates``: return the
    candidates (when the vocabulary is wider than them) for a draw over those only."""
    S, V = x.shape
    x1, m = scaled_logits(x, md, is_random)
    truncated = is_random & ((md.top_k > 0) | (md.top_p < 1.0))
    with_candidates = keep_candidates and V > NUM_CANDIDATES
    out = jax.lax.cond(jnp.any(truncated), lambda: _thresholds(x1, m, md, zero, with_candidates),
                       lambda: _untruncated(S, with_candidates))
    tau, open_p, target = out[:3]
    return Truncation(x1, m, truncated, tau, open_p & is_random, target, out[3] if with_candidates else None)


def whole_key(x1: jax.Array, tau: jax.Array | None, m: jax.Array, open_p: jax.Array, target: jax.Array,
              zero: jax.Array, need: jax.Array | None = None) -> jax.Array:
    """The whole truncation key per row, [S] u32: ``tau`` raised, for the ``open_p`` rows, to
    the exact top-p key of the row masked by ``tau`` (:func:`topp_full_search`); ``tau`` None:
    x1 is masked already (the key is then the open rows' top-p key, 0 elsewhere).  The search
    runs only when a row of ``need`` (default ``open_p``) is set."""
    S = x1.shape[0]

    def open_rows():
        # Masked inside the branch: a value captured by a lax.cond branch is computed even if unused.
        xk = x1 if tau is None else apply_key(x1, tau)
        return topp_full_search(xk, m, target, zero)

    need = open_p if need is None else need
    tau_p = jax.lax.cond(jnp.any(need), open_rows, lambda: jnp.zeros((S,), jnp.uint32))
    if tau is None:
        return jnp.where(open_p, tau_p, jnp.uint32(0))
    return jnp.where(open_p, jnp.maximum(tau, tau_p), tau)


def apply_key(x1: jax.Array, tau: jax.Array) -> jax.Array:
    """x1 [S, V] with the entries below the row's key tau [S] set to -inf."""
    return jnp.where(nx.float_key(x1) >= tau[:, None], x1, NEG_INF)

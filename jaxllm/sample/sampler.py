"""The sampler of the compiled step: every row of the batch at once, greedy and random rows
in one executable, per-request parameters as ``[S]`` arrays.

Order of operations (vLLM v1's):

1. allowed_token_ids / bad words (single-token) / logit_bias: one additive per-request row
   of the :class:`SamplerState` (``-inf`` where a token is not allowed or banned), written
   once at admission; then min_tokens (stop ids) and multi-token bad words: the host lists
   the ids to suppress this step (``suppress``), set to ``-inf``.  Adding the bias before
   the suppression gives the same values as vLLM's order, since ``-inf + b = -inf``.
2. penalties: repetition (prompt and output tokens), frequency, presence, with vLLM's
   formulas, from per-request token counts kept on the device (:func:`update_state`).
3. greedy rows: argmax (lowest index among ties).
4. random rows: temperature, min_p, top-k, top-p, then a Gumbel-argmax draw whose noise is a
   pure function of (seed, output position, vocabulary index), see ``gumbel.py``.

Every float that decides a token is computed with exactly rounded, contraction-proof
operations (``numerics.py``) and every reduction that decides one is order-independent
(max, integer sums, lowest-index tie-break), so the draw equals the serial host reference
of ``reference.py`` bit for bit, whatever the batch row, the bucket or the reduction order.

Speed on CPU (XLA's ``argmax`` and ``sort`` are slow there: a variadic reduce and a
comparator sort) comes from working in blocks of ``BLOCK`` vocabulary entries:

* ``blocked_argmax``: a vectorised max per block, then the first block and the first
  index holding the maximum.
* Top-k / top-p thresholds: the ``CAND_BLOCKS`` blocks with the largest maxima hold every
  value above the next block's maximum; the k-th value and the top-p crossing are read off
  the sorted candidates when they lie above that bound.  Otherwise (large k, a flat
  distribution) a bitwise search over the float's monotone integer key finds the same
  threshold over the whole vocabulary: 32 passes of an exact count (top-k) or of exact
  fixed-point mass sums (top-p).
* The draw: a cheap upper bound of the noise (no logarithm) per element, its maximum per
  block, and the exact noise only in the ``CAND_BLOCKS`` blocks with the largest bounds; the
  result stands when the next block's bound is below the best exact score (it nearly
  always is), else the exact noise of the whole row decides.

Branches that no row needs this step (the random path, truncation, penalties, bias,
logprobs, the fallbacks) are skipped with ``lax.cond``, not compiled as variants.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import LOGPROBS_MODES  # noqa: F401  (re-exported)
from jaxllm.sample import numerics as nx
from jaxllm.sample.gumbel import element_bits, noise_at, noise_upper_bound, row_keys, runtime_zero

BLOCK = 64
"""Vocabulary entries per block of the argmax (divides 49,152, 151,936 and 248,320; other
widths are padded)."""
CAND_BLOCK = 16
"""Block size of the candidate searches (finer blocks: fewer candidates per useful entry)."""
TRUNC_BLOCKS = 64
"""Blocks whose entries the top-k / top-p threshold search examines (1,024 per row)."""
DRAW_BLOCKS = 16
"""Blocks whose entries get the exact noise in the draw (256 per row)."""
SUPPRESS_WIDTH = 128
"""Ids one row may suppress in one step (min_tokens stop ids + multi-token bad words), like
vLLM's MAX_NUM_STOP_TOKEN_IDS."""

_NEG_INF = -np.inf


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling parameters of one step (rows are batch rows, padded to the bucket)."""

    temperature: jax.Array         # [S] f32, <= 0: greedy
    top_k: jax.Array               # [S] i32, 0: off
    top_p: jax.Array               # [S] f32, 1: off
    log_min_p: jax.Array           # [S] f32, log(min_p) taken on the host; -inf: off
    seed_lo: jax.Array             # [S] u32
    seed_hi: jax.Array             # [S] u32
    out_pos: jax.Array             # [S] i32, index of the output token being drawn (>= 0)
    num_logprobs: jax.Array        # [S] i32, -1: none requested
    slot: jax.Array                # [S] i32, the request's row in SamplerState
    reset: jax.Array               # [S] bool, zero the slot's counts before counting this step
    track: jax.Array               # [S] bool, the request uses penalties (its tokens are counted)
    num_prompt: jax.Array          # [S] i32, prompt length: earlier positions are prompt tokens
    repetition_penalty: jax.Array  # [S] f32, 1: off
    presence_penalty: jax.Array    # [S] f32, 0: off
    frequency_penalty: jax.Array   # [S] f32, 0: off
    use_bias: jax.Array            # [S] bool, add the slot's bias row
    suppress: jax.Array            # [S, SUPPRESS_WIDTH] i32, ids set to -inf this step, -1: none


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerState:
    """Per-request device state, rows assigned to request ids by the runner (never batch rows);
    the last row is scratch for padding rows and untracked tokens.  Donated to every step."""

    counts: jax.Array       # [R, V] i32, output-token counts
    prompt_mask: jax.Array  # [R, V] bool, token occurs in the prompt
    bias: jax.Array         # [R, V] f32, logit_bias, -inf for disallowed / banned tokens


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array        # [S] i32
    sampled_logprob: jax.Array  # [S] f32
    sampled_rank: jax.Array     # [S] i32, 1-based
    top_ids: jax.Array          # [S, K] i32
    top_logprobs: jax.Array     # [S, K] f32


def state_shapes(num_rows: int, vocab_size: int) -> SamplerState:
    return SamplerState(counts=jax.ShapeDtypeStruct((num_rows, vocab_size), jnp.int32),
                        prompt_mask=jax.ShapeDtypeStruct((num_rows, vocab_size), jnp.bool_),
                        bias=jax.ShapeDtypeStruct((num_rows, vocab_size), jnp.float32))


def init_state(num_rows: int, vocab_size: int) -> SamplerState:
    return SamplerState(counts=jnp.zeros((num_rows, vocab_size), jnp.int32),
                        prompt_mask=jnp.zeros((num_rows, vocab_size), jnp.bool_),
                        bias=jnp.zeros((num_rows, vocab_size), jnp.float32))


def write_bias_row(bias: jax.Array, slot: jax.Array, row: jax.Array) -> jax.Array:
    """bias [R, V] (donated), slot [] i32, row [V] f32 -> bias with row ``slot`` replaced."""
    return bias.at[slot].set(row)


def write_penalty_row(counts: jax.Array, prompt_mask: jax.Array, slot: jax.Array, counts_row: jax.Array,
                      mask_row: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Replaces row ``slot`` of the penalty state (both donated): the counts and prompt mask of
    tokens that never pass through a step (a prefix served from the KV cache)."""
    return counts.at[slot].set(counts_row), prompt_mask.at[slot].set(mask_row)


# ---------------------------------------------------------------- penalty state

def update_state(state: SamplerState, md: SamplingMetadata, input_ids: jax.Array, token_row: jax.Array,
                 positions: jax.Array, num_tokens: jax.Array) -> SamplerState:
    """Counts this step's tokens of tracked requests: prompt positions into ``prompt_mask``,
    later positions (sampled tokens fed back, or recomputed after preemption) into
    ``counts``.  A decode step feeds the token sampled last, so the counts a row sees when
    it samples cover all its earlier output tokens.  ``input_ids``/``token_row``/``positions``
    [T]; ``num_tokens`` [] the real tokens (the rest is padding)."""
    counts, prompt = state.counts, state.prompt_mask
    scratch = counts.shape[0] - 1

    def reset(cp):
        rows = jnp.where(md.reset, md.slot, scratch)                     # [S]
        return cp[0].at[rows].set(0), cp[1].at[rows].set(False)

    counts, prompt = jax.lax.cond(jnp.any(md.reset), reset, lambda cp: cp, (counts, prompt))
    T = input_ids.shape[0]
    row = token_row
    tracked = (jnp.arange(T) < num_tokens) & md.track[row]               # [T]
    tslot = jnp.where(tracked, md.slot[row], scratch)                    # [T]
    in_prompt = positions < md.num_prompt[row]                           # [T]
    counts = counts.at[tslot, input_ids].add((tracked & ~in_prompt).astype(jnp.int32))
    prompt = prompt.at[tslot, input_ids].max(tracked & in_prompt)
    return SamplerState(counts=counts, prompt_mask=prompt, bias=state.bias)


# ---------------------------------------------------------------- blocked reductions

def _blocks(x: jax.Array, fill, block: int = BLOCK) -> jax.Array:
    """[S, V] -> [S, nb, block], padded with ``fill``."""
    S, V = x.shape
    pad = -V % block
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill)
    return x.reshape(S, (V + pad) // block, block)


def _first_index(mask: jax.Array, index: jax.Array, big: int) -> jax.Array:
    return jnp.min(jnp.where(mask, index, big), axis=-1)


def blocked_argmax(y: jax.Array) -> jax.Array:
    """[S, V] float (no NaN) -> [S] i32: the lowest index of the row maximum.  (XLA:CPU's
    argmax is a scalar variadic reduce, ~3x slower than a vectorised max per block.)"""
    S, V = y.shape
    yb = _blocks(y, _NEG_INF)                                            # [S, nb, B]
    bm = yb.max(axis=-1)                                                 # [S, nb]
    m = bm.max(axis=-1)                                                  # [S]
    nb = bm.shape[1]
    blk = _first_index(bm == m[:, None], jnp.arange(nb, dtype=jnp.int32)[None], nb)   # [S]
    blk = jnp.minimum(blk, nb - 1)
    row = jnp.take_along_axis(yb, blk[:, None, None], axis=1)[:, 0]      # [S, B]
    j = _first_index(row == m[:, None], jnp.arange(BLOCK, dtype=jnp.int32)[None], BLOCK)
    return (blk * BLOCK + jnp.minimum(j, BLOCK - 1)).astype(jnp.int32)


def _candidates(x: jax.Array, n_blocks: int, block: int = CAND_BLOCK):
    """The entries of the ``n_blocks`` blocks with the largest maxima.

    Returns values [S, n*block], their indices [S, n*block] and ``outside`` [S]: an upper
    bound of every entry not among the candidates (-inf when every block is one)."""
    S, V = x.shape
    xb = _blocks(x, _NEG_INF, block)
    nb = xb.shape[1]
    n = min(n_blocks, nb)
    bm = xb.max(axis=-1)                                                 # [S, nb]
    # All of top_k's outputs are used as they are: XLA:CPU turns a top_k whose result is
    # sliced into a full sort (measured 25 ms instead of 0.6 ms at [32, 3072]).
    _, bi = jax.lax.top_k(bm, n)                                         # [S, n]
    vals = jnp.take_along_axis(xb, bi[:, :, None], axis=1).reshape(S, n * block)
    idx = (bi[:, :, None] * block + jnp.arange(block, dtype=jnp.int32)).reshape(S, n * block)
    chosen = jnp.zeros((S, nb), jnp.bool_).at[jnp.arange(S)[:, None], bi].set(True)
    outside = jnp.max(jnp.where(chosen, _NEG_INF, bm), axis=-1)          # [S]
    return vals, idx, outside


def blocked_top_k(y: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Exact top-k values and indices of each row ([S, V] -> [S, k]): the k largest entries lie
    in the k blocks with the largest maxima."""
    S, V = y.shape
    if V < k:                                                            # tiny test vocabularies
        v, i = jax.lax.top_k(y, V)
        return (jnp.pad(v, ((0, 0), (0, k - V)), constant_values=_NEG_INF),
                jnp.pad(i, ((0, 0), (0, k - V))))
    if V <= k * CAND_BLOCK:
        return jax.lax.top_k(y, k)
    vals, idx, _ = _candidates(y, k)
    v, pos = jax.lax.top_k(vals, k)
    return v, jnp.take_along_axis(idx, pos, axis=1)


# ---------------------------------------------------------------- processing (all rows)

def process_logits(logits: jax.Array, md: SamplingMetadata, state: SamplerState, zero: jax.Array) -> jax.Array:
    """Allowed / bad tokens, min_tokens, logit_bias, penalties: logits [S, V] -> [S, V].

    One ``lax.cond`` for all three (each materialises [S, V]), skipped when no row needs any."""
    S, V = logits.shape
    penalized = md.track & ((md.repetition_penalty != 1.0) | (md.presence_penalty != 0.0)
                            | (md.frequency_penalty != 0.0))

    def apply(x):
        x = jnp.where(md.use_bias[:, None], x + state.bias[md.slot], x)
        ids = jnp.where(md.suppress >= 0, md.suppress, V)                # out of range: dropped
        x = x.at[jnp.arange(S)[:, None], ids].set(_NEG_INF, mode="drop")

        def penalize(x):
            c = state.counts[md.slot]                                    # [S, V] i32
            out = c > 0
            occurred = state.prompt_mask[md.slot] | out
            rep = md.repetition_penalty[:, None]
            # vLLM: positive logits are divided by the penalty, the others multiplied.
            xr = jnp.where(occurred, jnp.where(x > 0, x / rep, nx.barrier(x * rep, zero)), x)
            xf = xr - nx.barrier(md.frequency_penalty[:, None] * c.astype(jnp.float32), zero)
            xp = jnp.where(out, xf - md.presence_penalty[:, None], xf)
            return jnp.where(penalized[:, None], xp, x)

        return jax.lax.cond(jnp.any(penalized), penalize, lambda x: x, x)

    needed = jnp.any(md.use_bias) | jnp.any(md.suppress >= 0) | jnp.any(penalized)
    return jax.lax.cond(needed, apply, lambda x: x, logits)


# ---------------------------------------------------------------- truncation (random rows)

def _search(pred, S: int) -> jax.Array:
    """Largest uint32 t with pred(t) [S] true, bit by bit from the top (pred monotone
    non-increasing in t, true at 0)."""
    def body(i, t):
        cand = t | (jnp.uint32(1) << (jnp.uint32(31) - i.astype(jnp.uint32)))
        return jnp.where(pred(cand), cand, t)
    return jax.lax.fori_loop(0, 32, body, jnp.zeros((S,), jnp.uint32))


def _count_at_least(keys, t):
    # Float sums of 0/1 are exact below 2^24 entries, whatever the order (and faster than int).
    return jnp.sum(jnp.where(keys >= t[:, None], 1.0, 0.0), axis=-1)


def _limbs(e):
    """e [S, N] -> [3, S, N] float32 fixed-point limbs (see numerics.limbs)."""
    return jnp.stack(nx.limbs(e))


def _mass(limbs, keep):
    """Exact fixed-point mass of the kept entries, [3, S, N] limbs (float32 integers < 2^12),
    keep [S, N] -> [S] float32: summed in float32 over blocks of 16 (exact below 2^24), then
    as int32 (exact below 2^31), so no reduction order can change the result.  (A uint32
    reduce over [S, V] is several times slower than a float one on XLA:CPU.)"""
    part = jnp.where(keep[None], limbs, 0.0)                             # [3, S, N]
    L, S, N = part.shape
    pad = -N % CAND_BLOCK
    if pad:
        part = jnp.pad(part, ((0, 0), (0, 0), (0, pad)))
    part = part.reshape(L, S, -1, CAND_BLOCK).sum(axis=-1)               # [3, S, nb] exact
    sums = part.astype(jnp.int32).sum(axis=-1).astype(jnp.uint32)        # [3, S]
    return nx.combine(sums[0], sums[1], sums[2])


def truncation_threshold(x: jax.Array, m: jax.Array, md: SamplingMetadata, zero: jax.Array,
                         impl: str = "threshold"):
    """Top-k then top-p over x [S, V] (temperature-scaled, min_p applied, no -0.0); m [S] the
    row maximum.  Returns ``(tau, open, target, cands)``: keep the entries whose ``float_key``
    >= tau [S] u32; for the rows where ``open`` [S] is set, tau is top-k's only and top-p is
    left to the draw (see :func:`gumbel_argmax`), with ``target`` [S] its mass (top_p *
    total).  ``cands`` (None for ``sort``): the candidates' values and indices [S, C] and
    ``inside`` [S], set where every kept entry is among them (see :func:`draw_candidates`).

    Top-k keeps every entry >= the k-th largest value; top-p keeps every entry >= the value
    at which the descending cumulative mass first reaches ``top_p`` of the total (vLLM's
    "smallest set with mass >= top_p", ties at the threshold kept); equivalently an entry
    is kept iff the mass of the entries strictly above it is below the target.  Masses are
    fixed-point integer sums of ``exp(x - m)``, so no summation order can change a decision,
    and both implementations keep the same entries:

    * ``threshold`` (default): a bitwise search for the largest key whose count (top-k) or
      mass (top-p) still reaches the target, over the entries of the ``TRUNC_BLOCKS``
      blocks with the largest maxima.  Above ``outside`` (the largest maximum of the other
      blocks) those counts and masses are the whole row's, so a result above it is exact.
      Otherwise top-k reruns the search over the whole row (32 passes of a count), and
      top-p (a nucleus wider than the candidates) is settled by the draw.
    * ``sort``: a full sort, k-th value and cumulative masses read off it (the baseline).
    """
    S, V = x.shape
    # The whole row's keys are computed inside each branch that needs them: a value captured
    # by a lax.cond branch is an operand, computed whether or not the branch runs.
    keys = lambda: nx.float_key(x)                                       # noqa: E731  [S, V] u32
    k_eff = jnp.where(md.top_k > 0, jnp.minimum(md.top_k, V), V)         # [S]
    u0 = jnp.uint32(0)
    no_open = jnp.zeros((S,), jnp.bool_)
    if impl == "sort":
        sv = jnp.sort(x, axis=-1)[:, ::-1]                               # [S, V] descending
        row_k = jnp.take_along_axis(sv, (k_eff - 1)[:, None], axis=1)[:, 0]
        tau_k = jnp.where(md.top_k > 0, nx.float_key(row_k), u0)
    else:
        cand, cidx, outside = _candidates(x, TRUNC_BLOCKS)               # [S, C], [S, C], [S]
        ckeys = nx.float_key(cand)
        out_key = nx.float_key(outside)
        tau_c = _search(lambda t: _count_at_least(ckeys, t) >= k_eff, S)
        ok_k = (md.top_k <= 0) | (tau_c > out_key)
        tau_k = jnp.where(md.top_k > 0, tau_c, u0)
        tau_k = jax.lax.cond(
            jnp.any(~ok_k),
            lambda: jnp.where(ok_k, tau_k, _search(lambda t, k=keys(): _count_at_least(k, t) >= k_eff, S)),
            lambda: tau_k)

    def full_mass():
        kept = keys() >= tau_k[:, None]
        return _mass(_limbs(nx.exp_nonpos(jnp.where(kept, x, _NEG_INF) - m[:, None], jnp, zero)), kept)

    def top_p():
        if impl == "sort":
            target = md.top_p * full_mass()                              # [S]
            svk = jnp.where(nx.float_key(sv) >= tau_k[:, None], sv, _NEG_INF)
            cl = [c.astype(jnp.uint32) for c in nx.limbs(nx.exp_nonpos(svk - m[:, None], jnp, zero))]
            cm = nx.combine(*(jnp.cumsum(c, axis=1, dtype=jnp.uint32) for c in cl))   # [S, V] non-decreasing
            j = jnp.sum(jnp.where(cm < target[:, None], 1, 0), axis=1)   # first index reaching it
            row_p = jnp.take_along_axis(svk, jnp.minimum(j, V - 1)[:, None], axis=1)[:, 0]
            tau_p = jnp.where(md.top_p < 1.0, nx.float_key(row_p), u0)
            return jnp.maximum(tau_k, tau_p), no_open, target
        ckept = ckeys >= tau_k[:, None]
        climb3 = _limbs(nx.exp_nonpos(jnp.where(ckept, cand, _NEG_INF) - m[:, None], jnp, zero))
        # The total is the candidates' when every other entry is cut by top-k (or min_p): then
        # the whole-row exponential is skipped.
        inside = (md.top_p >= 1.0) | (out_key < tau_k) | (outside == _NEG_INF)
        target = md.top_p * jax.lax.cond(jnp.all(inside), lambda: _mass(climb3, ckept), full_mass)
        tau_c = _search(lambda t: _mass(climb3, ckept & (ckeys >= t[:, None])) >= target, S)
        ok_p = (md.top_p >= 1.0) | (tau_c > out_key)
        tau_p = jnp.where(md.top_p < 1.0, tau_c, u0)
        return jnp.where(ok_p, jnp.maximum(tau_k, tau_p), tau_k), ~ok_p, target

    tau, open_p, target = jax.lax.cond(jnp.any(md.top_p < 1.0), top_p,
                                       lambda: (tau_k, no_open, jnp.zeros((S,), jnp.float32)))
    if impl == "sort":
        return tau, open_p, target, None
    # Every entry kept lies among the candidates when tau is above every other block's maximum.
    inside = ~open_p & ((tau > out_key) | (outside == _NEG_INF))
    return tau, open_p, target, (cand, cidx, inside)


def topp_full_search(x: jax.Array, m: jax.Array, target: jax.Array, zero: jax.Array) -> jax.Array:
    """The top-p threshold key over whole rows ([S, V], already top-k masked): 32 passes of an
    exact mass.  The slow path, for a nucleus wider than every shortcut."""
    S = x.shape[0]
    k = nx.float_key(x)
    limb3 = _limbs(nx.exp_nonpos(x - m[:, None], jnp, zero))
    return _search(lambda t: _mass(limb3, k >= t[:, None]) >= target, S)


# ---------------------------------------------------------------- the draw

OPEN_CANDIDATES = 8
"""Best-scoring draw candidates whose top-p membership is decided for a wide nucleus."""


def gumbel_argmax(x: jax.Array, md: SamplingMetadata, fp64: bool = False, only: jax.Array | None = None,
                  open_p: jax.Array | None = None, target: jax.Array | None = None,
                  m: jax.Array | None = None) -> jax.Array:
    """argmax_i (x_i + g_i), lowest index among ties; x [S, V] processed logits (-inf: masked).

    Exact noise is computed in the ``DRAW_BLOCKS`` blocks with the largest upper bounds
    ``x + noise_upper_bound`` (a bound without a logarithm).  When the best exact score
    beats every other block's bound, no other entry can reach it (nor tie it); otherwise
    (rare) the whole row's exact noise decides.  ``only`` [S]: rows whose result matters
    (the others never trigger the fallback).

    Rows in ``open_p`` still need top-p (a nucleus wider than the threshold search's
    candidates; ``target`` its mass, ``m`` the row maximum): an entry is in the nucleus iff
    the mass strictly above its value is below the target, so it suffices to decide that
    for the best-scoring entries, best first (one exact mass pass per probe, usually one or
    two for a whole batch), and take the first one inside.  If none of the
    ``OPEN_CANDIDATES`` best is inside, or a tie hides among them, the whole-row threshold
    search and draw run instead."""
    S, V = x.shape
    keys = row_keys(md.seed_lo, md.seed_hi, md.out_pos)                  # [S]
    zero = runtime_zero(md.out_pos)                                      # [S, 1]
    dt = jnp.float64 if fp64 else jnp.float32
    neg = jnp.asarray(_NEG_INF, dt)
    big = jnp.iinfo(jnp.int32).max
    bits = element_bits(keys, jnp.arange(V, dtype=jnp.uint32))           # [S, V]
    ub = x.astype(dt) + noise_upper_bound(bits, fp64).astype(dt)         # [S, V] >= x + g
    _, idx, outside = _candidates(ub, DRAW_BLOCKS)                       # [S, N], [S]
    xc = jnp.take_along_axis(_blocks(x, _NEG_INF, CAND_BLOCK).reshape(S, -1), idx, axis=1)   # [S, N]
    sc = xc.astype(dt) + noise_at(keys, idx, zero, fp64)                 # [S, N] exact scores
    best = sc.max(axis=-1)                                               # [S]
    win = _first_index(sc == best[:, None], idx, big)
    ok = outside < best
    if only is None:
        only = jnp.ones((S,), jnp.bool_)
    if open_p is None:
        open_p = jnp.zeros((S,), jnp.bool_)
    open_p = open_p & only

    def resolve_open():
        # Best-scoring candidate first: if its value is in the nucleus it wins; if not, no entry
        # of that value or lower is, so the next probe is the best candidate above it.  One
        # exact mass pass per probe, until every open row has its answer (most: one probe).
        M = min(OPEN_CANDIDATES, sc.shape[1])
        vals, pos = jax.lax.top_k(sc, M)                                 # [S, M] best scores
        cx = jnp.take_along_axis(xc, pos, axis=1)                        # their values
        cid = jnp.take_along_axis(idx, pos, axis=1)
        xkeys = nx.float_key(x)
        limb3 = _limbs(nx.exp_nonpos(x - m[:, None], jnp, zero))

        def probe(carry):
            lo_fail, done, w, okr, it = carry
            alive = cx > lo_fail[:, None]                                # not yet excluded
            bs = jnp.max(jnp.where(alive, vals, neg), axis=1)            # [S]
            first = alive & (vals == bs[:, None])
            j = jnp.minimum(_first_index(first, jnp.arange(M, dtype=jnp.int32)[None], M), M - 1)
            v = jnp.take_along_axis(cx, j[:, None], axis=1)[:, 0]
            kept = _mass(limb3, xkeys > nx.float_key(v)[:, None]) < target
            # A tie in score with a lower value (unknown membership) or with a lower index: give up.
            clean = jnp.sum(first, axis=1) == 1
            found = kept & ~done & jnp.any(alive, axis=1)
            w = jnp.where(found, jnp.take_along_axis(cid, j[:, None], axis=1)[:, 0], w)
            # Exact when every entry scoring >= bs is among the M (beyond them: <= min(vals), outside).
            okr = jnp.where(found, clean & (bs > vals.min(axis=1)) & (bs > outside), okr)
            exhausted = ~jnp.any(alive, axis=1)
            done = done | found | exhausted
            lo_fail = jnp.where(done, lo_fail, v)
            return lo_fail, done, w, okr, it + 1

        init = (jnp.full((S,), _NEG_INF, x.dtype), ~open_p, win.astype(jnp.int32), jnp.zeros((S,), jnp.bool_),
                jnp.int32(0))
        _, _, w, okr, _ = jax.lax.while_loop(lambda c: jnp.any(~c[1]) & (c[4] < M), probe, init)
        return w, okr

    if target is not None:
        w_open, ok_open = jax.lax.cond(jnp.any(open_p), resolve_open, lambda: (win, ok))
        win = jnp.where(open_p, w_open, win)
        ok = jnp.where(open_p, ok_open, ok)
    ok = ok | ~only

    def full():
        xx = x
        if target is not None:
            tau = jax.lax.cond(jnp.any(open_p & ~ok), lambda: topp_full_search(x, m, target, zero),
                               lambda: jnp.zeros((S,), jnp.uint32))
            xx = jnp.where(open_p[:, None] & (nx.float_key(x) < tau[:, None]), _NEG_INF, x)
        y = xx.astype(dt) + noise_at(keys, jnp.arange(V, dtype=jnp.uint32), zero, fp64)   # [S, V]
        return jnp.where(ok, win, blocked_argmax(y))

    return jax.lax.cond(jnp.all(ok), lambda: win, full).astype(jnp.int32)


def draw_candidates(x: jax.Array, idx: jax.Array, tau: jax.Array, md: SamplingMetadata, fp64: bool = False) -> jax.Array:
    """The draw of :func:`gumbel_argmax` when every kept entry is among the candidates x
    [S, C] (indices ``idx`` [S, C]): the same exact scores at the same indices, the rest of
    the row being -inf, so the same token, for C entries per row instead of V."""
    keys = row_keys(md.seed_lo, md.seed_hi, md.out_pos)                  # [S]
    zero = runtime_zero(md.out_pos)
    dt = jnp.float64 if fp64 else jnp.float32
    xc = jnp.where(nx.float_key(x) >= tau[:, None], x, _NEG_INF)        # [S, C]
    sc = xc.astype(dt) + noise_at(keys, idx, zero, fp64)                 # [S, C]
    best = sc.max(axis=-1)
    return _first_index(sc == best[:, None], idx, jnp.iinfo(jnp.int32).max).astype(jnp.int32)


# ---------------------------------------------------------------- the whole sampler

KERNEL_BACKENDS = ("xla", "pallas")
"""Where the draw runs: ``xla`` (:func:`gumbel_argmax` and friends above) or ``pallas``
(``jaxllm/pallas/gumbel_argmax.py``, one fused pass over the vocabulary, see :func:`pallas_draw`)."""


def scaled_logits(x: jax.Array, md: SamplingMetadata, is_random: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Temperature-scaled logits with min_p applied, and their row maximum before min_p:
    x [S, V] -> (x1 [S, V], m [S]).  Greedy rows are scaled by 1."""
    temp = jnp.where(is_random, md.temperature, 1.0)
    x1 = x / temp[:, None]
    x1 = jnp.where(x1 == 0.0, 0.0, x1)                                   # no -0.0 for the integer keys
    m = x1.max(axis=-1)                                                  # [S]
    return jnp.where(x1 - m[:, None] < md.log_min_p[:, None], _NEG_INF, x1), m   # min_p


def pallas_draw(x: jax.Array, md: SamplingMetadata, zero: jax.Array, processed_mode: bool, impl: str = "threshold"):
    """Every row's token (greedy and random) by the Pallas kernel: x [S, V] processed logits.

    The thresholds are computed here as on the XLA path (``truncation_threshold``), and for the
    rows whose nucleus is too wide for the candidate search (``open``) the exact top-p key by
    the whole-row search (what ``gumbel_argmax``'s ``full()`` does), so one key threshold per
    row holds all of top-k and top-p; the kernel applies it with temperature, min_p and the
    noise, and reduces over the vocabulary.  Returns ``tokens`` [S], or ``(tokens,
    processed)`` in the processed-logprobs modes (processed [S, V]: random rows' truncated
    logits, greedy rows' x, as on the XLA path)."""
    from jaxllm.pallas.gumbel_argmax import gumbel_argmax as pallas_gumbel_argmax

    S, V = x.shape
    is_random = md.temperature > 0.0
    u0 = jnp.zeros((S,), jnp.uint32)

    def thresholds():
        x1, m = scaled_logits(x, md, is_random)
        trunc = is_random & ((md.top_k > 0) | (md.top_p < 1.0))
        none = (u0, jnp.zeros((S,), jnp.bool_), jnp.zeros((S,), jnp.float32))
        tau, open_p, target = jax.lax.cond(
            jnp.any(trunc), lambda: truncation_threshold(x1, m, md, zero, impl)[:3], lambda: none)
        open_p = open_p & is_random
        # Open rows: tau is top-k's only; the exact top-p key over the top-k-masked row (masked
        # inside the branch: a value captured by a lax.cond branch is computed even if unused).
        tau_p = jax.lax.cond(
            jnp.any(open_p),
            lambda: topp_full_search(jnp.where(nx.float_key(x1) >= tau[:, None], x1, _NEG_INF), m, target, zero),
            lambda: u0)
        tau = jnp.where(open_p, jnp.maximum(tau, tau_p), tau)             # [S] the whole truncation
        if not processed_mode:
            return tau, m
        xf = jnp.where(nx.float_key(x1) >= tau[:, None], x1, _NEG_INF)
        return tau, m, jnp.where(is_random[:, None], xf, x)

    def greedy_only():
        out = (u0, jnp.zeros((S,), jnp.float32))
        return out + (x,) if processed_mode else out

    out = jax.lax.cond(jnp.any(is_random), thresholds, greedy_only)
    tau, m = out[0], out[1]
    tokens = pallas_gumbel_argmax(x, md.temperature, tau, md.log_min_p, m, md.seed_lo, md.seed_hi, md.out_pos)
    return (tokens, out[2]) if processed_mode else tokens


def sample(logits: jax.Array, md: SamplingMetadata, state: SamplerState, *, max_logprobs: int,
           logprobs_mode: str = "raw_logprobs", fp64: bool = False, impl: str = "threshold",
           kernel_backend: str = "xla") -> SamplerOutput:
    """logits [S, V] float32 -> SamplerOutput (the state is read, not changed: see update_state).

    ``kernel_backend``: ``xla`` (default) or ``pallas`` (the draw by the Pallas kernel, float32
    noise only; same tokens, see :func:`pallas_draw`)."""
    if kernel_backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend={kernel_backend!r}: expected one of {KERNEL_BACKENDS}")
    if kernel_backend == "pallas" and fp64:
        raise ValueError("kernel_backend='pallas' draws with float32 noise only; "
                         "fp64 Gumbel needs kernel_backend='xla'")
    S, V = logits.shape
    zero = runtime_zero(md.out_pos)                                      # [S, 1]
    x = process_logits(logits, md, state, zero)                          # [S, V]
    greedy = blocked_argmax(x)
    is_random = md.temperature > 0.0
    processed_mode = logprobs_mode.startswith("processed") and max_logprobs > 0

    def random_rows():
        x1, m = scaled_logits(x, md, is_random)
        trunc = is_random & ((md.top_k > 0) | (md.top_p < 1.0))
        C = TRUNC_BLOCKS * CAND_BLOCK
        none = (jnp.zeros((S,), jnp.uint32), jnp.zeros((S,), jnp.bool_), jnp.zeros((S,), jnp.float32))
        if impl == "sort" or V <= C:
            tau, open_p, target = jax.lax.cond(
                jnp.any(trunc), lambda: truncation_threshold(x1, m, md, zero, impl)[:3], lambda: none)
            cands = None
        else:
            tau, open_p, target, cands = jax.lax.cond(
                jnp.any(trunc), lambda: truncation_threshold(x1, m, md, zero, impl),
                lambda: (*none, (jnp.zeros((S, C), jnp.float32), jnp.zeros((S, C), jnp.int32),
                                 jnp.zeros((S,), jnp.bool_))))
        xf = jnp.where(nx.float_key(x1) >= tau[:, None], x1, _NEG_INF)

        def full_draw():
            return gumbel_argmax(xf, md, fp64, is_random, open_p, target, m)

        def draw():
            if cands is None:
                return full_draw()
            # Typical top-k / top-p: every random row's survivors are among the threshold
            # search's candidates, so the noise is needed for those only, not the whole row.
            cand, cidx, inside = cands
            closed = ~is_random | (trunc & inside)
            return jax.lax.cond(jnp.all(closed), lambda: draw_candidates(cand, cidx, tau, md, fp64), full_draw)

        if fp64:
            with jax.enable_x64(True):
                drawn = draw()
        else:
            drawn = draw()
        tokens = jnp.where(is_random, drawn, greedy)
        if not processed_mode:
            return tokens
        # The processed distribution needs the exact nucleus of the open rows too.
        tau_p = jax.lax.cond(jnp.any(open_p), lambda: topp_full_search(xf, m, target, zero),
                             lambda: jnp.zeros((S,), jnp.uint32))
        xf = jnp.where(open_p[:, None] & (nx.float_key(xf) < tau_p[:, None]), _NEG_INF, xf)
        return tokens, jnp.where(is_random[:, None], xf, x)

    if kernel_backend == "pallas":
        drawn = pallas_draw(x, md, zero, processed_mode, impl)
        tokens, processed = drawn if processed_mode else (drawn, None)
    elif processed_mode:
        tokens, processed = jax.lax.cond(jnp.any(is_random), random_rows, lambda: (greedy, x))
    else:
        tokens, processed = jax.lax.cond(jnp.any(is_random), random_rows, lambda: greedy), None
    K = max(max_logprobs, 1)

    def logprobs():
        src = logits if not processed_mode else processed
        lp = jax.nn.log_softmax(src, axis=-1) if logprobs_mode.endswith("logprobs") else src
        top_lp, top_ids = blocked_top_k(lp, K)
        chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
        rank = 1 + _count_at_least(lp, jnp.nextafter(chosen, jnp.inf)).astype(jnp.int32)
        return chosen, rank, top_ids.astype(jnp.int32), top_lp

    def no_logprobs():
        return (jnp.zeros((S,), jnp.float32), jnp.zeros((S,), jnp.int32),
                jnp.zeros((S, K), jnp.int32), jnp.zeros((S, K), jnp.float32))

    if max_logprobs > 0:
        chosen, rank, top_ids, top_lp = jax.lax.cond(jnp.any(md.num_logprobs >= 0), logprobs, no_logprobs)
    else:
        chosen, rank, top_ids, top_lp = no_logprobs()
    return SamplerOutput(tokens, chosen, rank, top_ids, top_lp)


def prompt_logprobs(logits_of, hidden: jax.Array, targets: jax.Array, k: int):
    """Raw logprobs of the next prompt token at each flat position (vLLM's prompt_logprobs).

    ``logits_of``: hidden [n, D] -> logits [n, V]; hidden [T, D]; targets [T] i32 (the token
    at position + 1, -1 where not requested).  Computed in chunks so a long prefill never
    materialises [T, V] at once.  Returns (logprob [T], rank [T], top ids [T, k], top [T, k])."""
    T = hidden.shape[0]
    chunk = 1
    while chunk < 256 and T % (chunk * 2) == 0:
        chunk *= 2
    K = max(k, 1)

    def one(args):
        h, t = args                                                      # [c, D], [c]
        lp = jax.nn.log_softmax(logits_of(h), axis=-1)                   # [c, V]
        top_lp, top_ids = blocked_top_k(lp, K)
        chosen = jnp.take_along_axis(lp, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]
        rank = 1 + _count_at_least(lp, jnp.nextafter(chosen, jnp.inf)).astype(jnp.int32)
        return chosen, rank, top_ids.astype(jnp.int32), top_lp

    out = jax.lax.map(one, (hidden.reshape(T // chunk, chunk, -1), targets.reshape(T // chunk, chunk)))
    return tuple(o.reshape(T, *o.shape[2:]) for o in out)

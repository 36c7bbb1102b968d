"""The draw: every row's token, greedy rows by argmax and random rows by Gumbel-argmax
``argmax_i (x_i + g_i)`` over their truncated logits, the noise ``g`` a pure function of
(seed, output position, vocabulary index) (``gumbel.py``), ties to the lowest index.

Two backends (``KERNEL_BACKENDS``), the same tokens:

* ``xla`` (:func:`draw_xla`): a cheap upper bound of the noise (no logarithm) per element,
  its maximum per block, and the exact noise only in the ``DRAW_BLOCKS`` blocks with the
  largest bounds; the result stands when the next block's bound is below the best exact
  score (it nearly always is), else the exact noise of the whole row decides
  (:func:`gumbel_argmax`).  When every random row's survivors lie among the truncation's
  candidates, only those get noise (:func:`draw_candidates`).
* ``pallas`` (:func:`draw_pallas`): the whole truncation key per row, then one fused pass
  over the vocabulary in ``jaxllm/pallas/gumbel_argmax.py``.

Both return ``(tokens [S], processed)``: ``processed`` [S, V] is the distribution the
processed-logprobs modes report (random rows' truncated logits, greedy rows' x), None
when not asked for.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.formats import numerics as nx
from jaxllm.formats.gumbel import element_bits, noise_at, noise_upper_bound, row_keys, runtime_zero
from jaxllm.pallas.gumbel_argmax import gumbel_argmax as pallas_gumbel_argmax
from jaxllm.sample.arrays import SamplingMetadata
from jaxllm.sample.blocked import CAND_BLOCK, NEG_INF, blocked_argmax, first_index
from jaxllm.sample.truncation import Truncation, apply_key, mass, limbs, truncate, whole_key

KERNEL_BACKENDS = ("xla", "pallas")
"""Where the draw runs: ``xla`` (:func:`draw_xla`) or ``pallas`` (:func:`draw_pallas`)."""
DRAW_BLOCKS = 16
"""Blocks whose entries get the exact noise in the draw (256 per row)."""
OPEN_CANDIDATES = 8
"""Best-scoring draw candidates whose top-p membership is decided for a wide nucleus."""

_BIG = jnp.iinfo(jnp.int32).max


class _Scored(NamedTuple):
    """The draw's candidates: the entries of the blocks with the largest noise bounds."""

    idx: jax.Array      # [S, N] i32 vocabulary indices
    xc: jax.Array       # [S, N] their values
    sc: jax.Array       # [S, N] their exact scores x + g (float64 with fp64)
    outside: jax.Array  # [S] an upper bound of every other entry's score


def _strided_bound_maxima(x: jax.Array, keys: jax.Array, fp64: bool) -> jax.Array:
    """x [S, V] -> [S, nb] the largest noise bound ``x + noise_upper_bound`` of each strided
    block: block b holds the entries b, b + nb, ..., b + (CAND_BLOCK - 1) nb (V padded to
    CAND_BLOCK * nb with -inf).

    Strided, not contiguous, so that the maximum is CAND_BLOCK elementwise maxima of
    contiguous [S, nb] slices, which XLA fuses with the hash into one vectorised loop; a
    max over contiguous 16-entry blocks is a separate reduction over a materialised [S, V]
    bound (XLA:CPU hands it to YNNPACK): ~45% of a batch-1 draw's time at V = 49,152.  Any
    partition into blocks gives the same token (the draw's argument needs only an upper
    bound of every entry outside the candidates)."""
    S, V = x.shape
    nb = -(-V // CAND_BLOCK)
    dt = jnp.float64 if fp64 else jnp.float32
    xp = jnp.pad(x, ((0, 0), (0, nb * CAND_BLOCK - V)), constant_values=NEG_INF) if nb * CAND_BLOCK > V else x
    bits = element_bits(keys, jnp.arange(nb * CAND_BLOCK, dtype=jnp.uint32))   # [S, nb * 16]
    ub = xp.astype(dt) + noise_upper_bound(bits, fp64).astype(dt)        # [S, nb * 16] >= x + g
    bm = ub[:, :nb]
    for i in range(1, CAND_BLOCK):
        bm = jnp.maximum(bm, ub[:, i * nb:(i + 1) * nb])                 # [S, nb]
    return bm


def _score_candidates(x: jax.Array, keys: jax.Array, zero: jax.Array, fp64: bool) -> _Scored:
    S, V = x.shape
    dt = jnp.float64 if fp64 else jnp.float32
    bm = _strided_bound_maxima(x, keys, fp64)                            # [S, nb]
    nb = bm.shape[1]
    n = min(DRAW_BLOCKS, nb)
    # All of top_k's outputs are used as they are (blocked.candidates: a sliced top_k
    # becomes a full sort on XLA:CPU).
    _, bi = jax.lax.top_k(bm, n)                                         # [S, n]
    idx = (bi[:, :, None] + nb * jnp.arange(CAND_BLOCK, dtype=jnp.int32)).reshape(S, n * CAND_BLOCK)
    chosen = jnp.zeros((S, nb), jnp.bool_).at[jnp.arange(S)[:, None], bi].set(True)
    outside = jnp.max(jnp.where(chosen, NEG_INF, bm), axis=-1)           # [S] bound of the rest
    # padding indices (>= V) score -inf: never a winner, never beating a real entry
    xc = jnp.where(idx < V, jnp.take_along_axis(x, jnp.minimum(idx, V - 1), axis=1), NEG_INF)   # [S, N]
    sc = xc.astype(dt) + noise_at(keys, idx, zero, fp64)                 # [S, N] exact scores
    return _Scored(idx, xc, sc, outside)


def _probe_open(x, s: _Scored, win, open_p, target, m, zero, fp64: bool):
    """The open rows' token among the best-scoring candidates: (token [S], exact [S]).

    Best-scoring candidate first: if its value is in the nucleus it wins; if not, no entry of
    that value or lower is, so the next probe is the best candidate above it.  One exact mass
    pass per probe, until every open row has its answer (most: one probe)."""
    S = x.shape[0]
    neg = jnp.asarray(NEG_INF, jnp.float64 if fp64 else jnp.float32)
    M = min(OPEN_CANDIDATES, s.sc.shape[1])
    vals, pos = jax.lax.top_k(s.sc, M)                                   # [S, M] best scores
    cx = jnp.take_along_axis(s.xc, pos, axis=1)                          # their values
    cid = jnp.take_along_axis(s.idx, pos, axis=1)
    xkeys = nx.float_key(x)
    limb3 = limbs(nx.exp_nonpos(x - m[:, None], jnp, zero))

    def probe(carry):
        lo_fail, done, w, okr, it = carry
        alive = cx > lo_fail[:, None]                                    # not yet excluded
        bs = jnp.max(jnp.where(alive, vals, neg), axis=1)                # [S]
        first = alive & (vals == bs[:, None])
        j = jnp.minimum(first_index(first, jnp.arange(M, dtype=jnp.int32)[None], M), M - 1)
        v = jnp.take_along_axis(cx, j[:, None], axis=1)[:, 0]
        kept = mass(limb3, xkeys > nx.float_key(v)[:, None]) < target
        # A tie in score with a lower value (unknown membership) or with a lower index: give up.
        clean = jnp.sum(first, axis=1) == 1
        found = kept & ~done & jnp.any(alive, axis=1)
        w = jnp.where(found, jnp.take_along_axis(cid, j[:, None], axis=1)[:, 0], w)
        # Exact when every entry scoring >= bs is among the M (beyond them: <= min(vals), outside).
        okr = jnp.where(found, clean & (bs > vals.min(axis=1)) & (bs > s.outside), okr)
        exhausted = ~jnp.any(alive, axis=1)
        done = done | found | exhausted
        lo_fail = jnp.where(done, lo_fail, v)
        return lo_fail, done, w, okr, it + 1

    init = (jnp.full((S,), NEG_INF, x.dtype), ~open_p, win.astype(jnp.int32), jnp.zeros((S,), jnp.bool_),
            jnp.int32(0))
    _, _, w, okr, _ = jax.lax.while_loop(lambda c: jnp.any(~c[1]) & (c[4] < M), probe, init)
    return w, okr


def _whole_row_draw(x, keys, zero, fp64: bool, win, ok, open_p, target, m):
    """The fallback: the exact noise of the whole row for the rows not ``ok``, the open rows
    first truncated to their exact nucleus."""
    V = x.shape[1]
    dt = jnp.float64 if fp64 else jnp.float32
    if target is not None:
        tau = whole_key(x, None, m, open_p, target, zero, need=open_p & ~ok)
        x = apply_key(x, tau)
    y = x.astype(dt) + noise_at(keys, jnp.arange(V, dtype=jnp.uint32), zero, fp64)   # [S, V]
    return jnp.where(ok, win, blocked_argmax(y))


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
    s = _score_candidates(x, keys, zero, fp64)
    best = s.sc.max(axis=-1)                                             # [S]
    win = first_index(s.sc == best[:, None], s.idx, _BIG)
    ok = s.outside < best
    if only is None:
        only = jnp.ones((S,), jnp.bool_)
    if open_p is None:
        open_p = jnp.zeros((S,), jnp.bool_)
    open_p = open_p & only
    if target is not None:
        w_open, ok_open = jax.lax.cond(jnp.any(open_p), lambda: _probe_open(x, s, win, open_p, target, m, zero, fp64),
                                       lambda: (win, ok))
        win = jnp.where(open_p, w_open, win)
        ok = jnp.where(open_p, ok_open, ok)
    ok = ok | ~only
    return jax.lax.cond(jnp.all(ok), lambda: win,
                        lambda: _whole_row_draw(x, keys, zero, fp64, win, ok, open_p, target, m)).astype(jnp.int32)


def draw_candidates(x: jax.Array, idx: jax.Array, tau: jax.Array, md: SamplingMetadata, fp64: bool = False) -> jax.Array:
    """The draw of :func:`gumbel_argmax` when every kept entry is among the candidates x
    [S, C] (indices ``idx`` [S, C]): the same exact scores at the same indices, the rest of
    the row being -inf, so the same token, for C entries per row instead of V."""
    keys = row_keys(md.seed_lo, md.seed_hi, md.out_pos)                  # [S]
    zero = runtime_zero(md.out_pos)
    dt = jnp.float64 if fp64 else jnp.float32
    xc = jnp.where(nx.float_key(x) >= tau[:, None], x, NEG_INF)         # [S, C]
    sc = xc.astype(dt) + noise_at(keys, idx, zero, fp64)                 # [S, C]
    best = sc.max(axis=-1)
    return first_index(sc == best[:, None], idx, _BIG).astype(jnp.int32)


# ---------------------------------------------------------------- XLA backend

def _draw_truncated(xf: jax.Array, tr: Truncation, md: SamplingMetadata, is_random: jax.Array, fp64: bool):
    """The random rows' tokens from their truncated logits xf [S, V]."""
    def whole_rows():
        return gumbel_argmax(xf, md, fp64, is_random, tr.open, tr.target, tr.m)

    if tr.cands is None:
        return whole_rows()
    # Typical top-k / top-p: every random row's survivors are among the threshold search's
    # candidates, so the noise is needed for those only, not the whole row.
    cand, cidx, inside = tr.cands
    closed = ~is_random | (tr.truncated & inside)
    return jax.lax.cond(jnp.all(closed), lambda: draw_candidates(cand, cidx, tr.tau, md, fp64), whole_rows)


def _random_rows(x: jax.Array, md: SamplingMetadata, zero: jax.Array, fp64: bool, processed_mode: bool):
    """Tokens of a batch holding random rows: truncation, then the draw (and the greedy rows'
    argmax only when there are any: a batch-1 step at temperature 1 has none)."""
    is_random = md.temperature > 0.0
    greedy = jax.lax.cond(jnp.all(is_random), lambda: jnp.zeros(is_random.shape, jnp.int32),
                          lambda: blocked_argmax(x))
    tr = truncate(x, md, zero, is_random, keep_candidates=True)
    xf = apply_key(tr.x1, tr.tau)                                        # [S, V]
    if fp64:
        with jax.enable_x64(True):
            drawn = _draw_truncated(xf, tr, md, is_random, fp64)
    else:
        drawn = _draw_truncated(xf, tr, md, is_random, fp64)
    tokens = jnp.where(is_random, drawn, greedy)
    if not processed_mode:
        return tokens, None
    # The processed distribution needs the exact nucleus of the open rows too.
    xf = apply_key(tr.x1, whole_key(tr.x1, tr.tau, tr.m, tr.open, tr.target, zero))
    return tokens, jnp.where(is_random[:, None], xf, x)


def draw_xla(x: jax.Array, md: SamplingMetadata, zero: jax.Array, fp64: bool, processed_mode: bool):
    """Every row's token by XLA: x [S, V] processed logits -> (tokens [S], processed or None).
    The random path runs only when a row is random."""
    is_random = md.temperature > 0.0
    return jax.lax.cond(jnp.any(is_random), lambda: _random_rows(x, md, zero, fp64, processed_mode),
                        lambda: (blocked_argmax(x), x if processed_mode else None))


# ---------------------------------------------------------------- Pallas backend

def _pallas_thresholds(x: jax.Array, md: SamplingMetadata, zero: jax.Array, processed_mode: bool):
    """(tau [S] the whole truncation key, m [S], processed or None) for a batch with random rows."""
    is_random = md.temperature > 0.0
    tr = truncate(x, md, zero, is_random, keep_candidates=False)
    tau = whole_key(tr.x1, tr.tau, tr.m, tr.open, tr.target, zero)
    if not processed_mode:
        return tau, tr.m, None
    return tau, tr.m, jnp.where(is_random[:, None], apply_key(tr.x1, tau), x)


def draw_pallas(x: jax.Array, md: SamplingMetadata, zero: jax.Array, processed_mode: bool):
    """Every row's token (greedy and random) by the Pallas kernel: x [S, V] processed logits
    -> (tokens [S], processed or None).

    One key threshold per row holds all of top-k and top-p (:func:`truncation.whole_key`);
    the kernel applies it with temperature, min_p and the noise, and reduces over the
    vocabulary."""

    S = x.shape[0]
    is_random = md.temperature > 0.0

    def greedy_only():
        return jnp.zeros((S,), jnp.uint32), jnp.zeros((S,), jnp.float32), x if processed_mode else None

    tau, m, processed = jax.lax.cond(jnp.any(is_random), lambda: _pallas_thresholds(x, md, zero, processed_mode),
                                     greedy_only)
    tokens = pallas_gumbel_argmax(x, md.temperature, tau, md.log_min_p, m, md.seed_lo, md.seed_hi, md.out_pos)
    return tokens, processed

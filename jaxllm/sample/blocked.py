"""Reductions over the vocabulary in blocks, the sampler's answer to XLA:CPU's slow ``argmax``
(a scalar variadic reduce) and ``sort`` (a comparator sort).

* :func:`blocked_argmax`: a vectorised max per block, then the first block and the first
  index holding the maximum.
* :func:`candidates`: the entries of the blocks with the largest maxima, and a bound of every
  other entry: the top-k / top-p threshold search and the draw look only there first.
* :func:`blocked_top_k`: exact top-k (logprobs), the k largest entries lie in the k blocks
  with the largest maxima.

Every reduction is a max, a min of indices or an exact count, so no evaluation order can
change a result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 64
"""Vocabulary entries per block of the argmax (divides 49,152, 151,936 and 248,320; other
widths are padded)."""
CAND_BLOCK = 16
"""Block size of the candidate searches (finer blocks: fewer candidates per useful entry)."""

NEG_INF = -np.inf


def blocks(x: jax.Array, fill, block: int = BLOCK) -> jax.Array:
    """[S, V] -> [S, nb, block], padded with ``fill``."""
    S, V = x.shape
    pad = -V % block
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill)
    return x.reshape(S, (V + pad) // block, block)


def first_index(mask: jax.Array, index: jax.Array, big: int) -> jax.Array:
    """The smallest ``index`` where ``mask`` holds along the last axis (``big`` where none)."""
    return jnp.min(jnp.where(mask, index, big), axis=-1)


def count_at_least(keys: jax.Array, t: jax.Array) -> jax.Array:
    """keys [S, N], t [S] -> [S] float32: how many entries of each row are >= t."""
    # Float sums of 0/1 are exact below 2^24 entries, whatever the order (and faster than int).
    return jnp.sum(jnp.where(keys >= t[:, None], 1.0, 0.0), axis=-1)


def blocked_argmax(y: jax.Array) -> jax.Array:
    """[S, V] float (no NaN) -> [S] i32: the lowest index of the row maximum.  (XLA:CPU's
    argmax is a scalar variadic reduce, ~3x slower than a vectorised max per block.)"""
    S, V = y.shape
    yb = blocks(y, NEG_INF)                                              # [S, nb, B]
    # The barrier keeps XLA from folding the max of the block maxima into a second
    # reduction over the whole row (it reads [S, V] again: ~40 us of a batch-1 greedy
    # step at V = 49,152 on CPU, as much as the block maxima themselves).
    bm = jax.lax.optimization_barrier(yb.max(axis=-1))                  # [S, nb]
    m = bm.max(axis=-1)                                                  # [S]
    nb = bm.shape[1]
    blk = first_index(bm == m[:, None], jnp.arange(nb, dtype=jnp.int32)[None], nb)   # [S]
    blk = jnp.minimum(blk, nb - 1)
    row = jnp.take_along_axis(yb, blk[:, None, None], axis=1)[:, 0]      # [S, B]
    j = first_index(row == m[:, None], jnp.arange(BLOCK, dtype=jnp.int32)[None], BLOCK)
    return (blk * BLOCK + jnp.minimum(j, BLOCK - 1)).astype(jnp.int32)


def candidates(x: jax.Array, n_blocks: int, block: int = CAND_BLOCK):
    """The entries of the ``n_blocks`` blocks with the largest maxima.

    Returns values [S, n*block], their indices [S, n*block] and ``outside`` [S]: an upper
    bound of every entry not among the candidates (-inf when every block is one)."""
    S, V = x.shape
    xb = blocks(x, NEG_INF, block)
    nb = xb.shape[1]
    n = min(n_blocks, nb)
    bm = xb.max(axis=-1)                                                 # [S, nb]
    # All of top_k's outputs are used as they are: XLA:CPU turns a top_k whose result is
    # sliced into a full sort (measured 25 ms instead of 0.6 ms at [32, 3072]).
    _, bi = jax.lax.top_k(bm, n)                                         # [S, n]
    vals = jnp.take_along_axis(xb, bi[:, :, None], axis=1).reshape(S, n * block)
    idx = (bi[:, :, None] * block + jnp.arange(block, dtype=jnp.int32)).reshape(S, n * block)
    chosen = jnp.zeros((S, nb), jnp.bool_).at[jnp.arange(S)[:, None], bi].set(True)
    outside = jnp.max(jnp.where(chosen, NEG_INF, bm), axis=-1)           # [S]
    return vals, idx, outside


def blocked_top_k(y: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Exact top-k values and indices of each row ([S, V] -> [S, k]): the k largest entries lie
    in the k blocks with the largest maxima."""
    S, V = y.shape
    if V < k:                                                            # tiny test vocabularies
        v, i = jax.lax.top_k(y, V)
        return (jnp.pad(v, ((0, 0), (0, k - V)), constant_values=NEG_INF),
                jnp.pad(i, ((0, 0), (0, k - V))))
    if V <= k * CAND_BLOCK:
        return jax.lax.top_k(y, k)
    vals, idx, _ = candidates(y, k)
    v, pos = jax.lax.top_k(vals, k)
    return v, jnp.take_along_axis(idx, pos, axis=1)

"""The sampler of the compiled step: greedy and random rows in one executable.

Order of operations (vLLM's): greedy argmax of the raw logits for greedy rows; for random
rows, temperature, min_p, top-k/top-p truncation, then a Gumbel-argmax draw whose noise
is a pure function of (seed, output position, vocabulary index).  Raw logprobs (before
any processing, vLLM's default) of the sampled token and of the top ``max_logprobs`` are
returned when any row asks for them.  Branches that no row needs this step (the draw,
the sort, the logprobs) are skipped with ``lax.cond``, not compiled as variants.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.sample.gumbel import gumbel_noise

_NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array   # [S] float32, 0 = greedy
    top_k: jax.Array         # [S] int32, 0 = off
    top_p: jax.Array         # [S] float32, 1 = off
    min_p: jax.Array         # [S] float32, 0 = off
    seed_lo: jax.Array       # [S] uint32
    seed_hi: jax.Array       # [S] uint32
    out_pos: jax.Array       # [S] int32, index of the output token being drawn
    num_logprobs: jax.Array  # [S] int32, -1 = none requested


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array       # [S] int32
    sampled_logprob: jax.Array  # [S] float32 (raw)
    sampled_rank: jax.Array    # [S] int32, 1-based
    top_ids: jax.Array         # [S, K] int32
    top_logprobs: jax.Array    # [S, K] float32


def _truncate(x: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Masks (to -inf) what top-k and top-p exclude; x [S, V] temperature-scaled logits."""
    S, V = x.shape
    srt = jnp.sort(x, axis=-1)[:, ::-1]                                  # [S, V] descending
    k = jnp.where(md.top_k > 0, jnp.minimum(md.top_k, V), V)             # [S]
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)            # [S, 1]
    probs = jax.nn.softmax(jnp.where(jnp.arange(V)[None, :] < k[:, None], srt, _NEG_INF), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (always at least one token).
    before = jnp.cumsum(probs, axis=-1) - probs                          # mass strictly above each
    keep = (before < md.top_p[:, None]) & (jnp.arange(V)[None, :] < k[:, None])
    n_keep = jnp.maximum(keep.sum(axis=-1), 1)
    pth = jnp.take_along_axis(srt, (n_keep - 1)[:, None], axis=-1)       # [S, 1]
    return jnp.where(x >= jnp.maximum(kth, pth), x, _NEG_INF)


def _draw(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    S, V = logits.shape
    temp = jnp.where(md.temperature > 0, md.temperature, 1.0)
    x = logits / temp[:, None]
    # min_p: p_i >= min_p * p_max  <=>  x_i - x_max >= log(min_p)
    x_max = x.max(axis=-1, keepdims=True)
    x = jnp.where((md.min_p[:, None] > 0) & (x - x_max < jnp.log(md.min_p)[:, None]), _NEG_INF, x)
    needs_sort = jnp.any((md.top_k > 0) | (md.top_p < 1.0))
    x = jax.lax.cond(needs_sort, _truncate, lambda x, md: x, x, md)
    g = gumbel_noise(md.seed_lo, md.seed_hi, md.out_pos, V)
    # argmax returns the lowest index among ties.
    return jnp.argmax(x + g, axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, md: SamplingMetadata, max_logprobs: int) -> SamplerOutput:
    """logits [S, V] float32 -> SamplerOutput."""
    S, V = logits.shape
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_random = md.temperature > 0
    tokens = jax.lax.cond(jnp.any(is_random),
                          lambda: jnp.where(is_random, _draw(logits, md), greedy),
                          lambda: greedy)
    K = max(max_logprobs, 1)

    def logprobs():
        lp = jax.nn.log_softmax(logits, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, K)
        chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
        rank = 1 + jnp.sum(lp > chosen[:, None], axis=-1)
        return chosen, rank.astype(jnp.int32), top_ids.astype(jnp.int32), top_lp

    def no_logprobs():
        return (jnp.zeros((S,), jnp.float32), jnp.zeros((S,), jnp.int32),
                jnp.zeros((S, K), jnp.int32), jnp.zeros((S, K), jnp.float32))

    if max_logprobs > 0:
        chosen, rank, top_ids, top_lp = jax.lax.cond(jnp.any(md.num_logprobs >= 0), logprobs, no_logprobs)
    else:
        chosen, rank, top_ids, top_lp = no_logprobs()
    return SamplerOutput(tokens, chosen, rank, top_ids, top_lp)

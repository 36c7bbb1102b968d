"""Logit processing before any draw, every row at once, and the per-request state it reads.

Order (vLLM v1's):

1. allowed_token_ids / bad words (single-token) / logit_bias: one additive per-request row
   of the :class:`SamplerState` (``-inf`` where a token is not allowed or banned), written
   once at admission (:func:`write_bias_row`); then min_tokens (stop ids) and multi-token
   bad words: the host lists the ids to suppress this step (``suppress``), set to ``-inf``.
   Adding the bias before the suppression gives the same values as vLLM's order, since
   ``-inf + b = -inf``.
2. penalties: repetition (prompt and output tokens), frequency, presence, with vLLM's
   formulas, from per-request token counts kept on the device (:func:`update_state`, run by
   the step; :func:`write_penalty_row` for a prefix served from the KV cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.formats import numerics as nx
from jaxllm.sample.arrays import SamplerState, SamplingMetadata
from jaxllm.sample.blocked import NEG_INF


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


def update_state(state: SamplerState, md: SamplingMetadata, input_ids: jax.Array, token_row: jax.Array,
                 positions: jax.Array, num_tokens: jax.Array) -> SamplerState:
    """Counts this step's tokens of tracked requests: prompt positions into ``prompt_mask``,
    later positions (sampled tokens fed back, or recomputed after preemption) into
    ``counts``.  A decode step feeds the token sampled last, so the counts a row sees when
    it samples cover all its earlier output tokens.  ``input_ids``/``token_row``/``positions``
    [T], ``token_row`` the sampling row of each token's request (of its position, for a
    verification); ``num_tokens`` [] the real tokens (the rest is padding).

    Speculation: the proposals a verification feeds are not counted (``count_fed``), since
    only some will be accepted; each row's draw sees the ones before it (``view_extra``, in
    :func:`_penalize`) and the accepted ones are counted in the request's next step
    (``count_extra``)."""
    counts, prompt = state.counts, state.prompt_mask
    scratch = counts.shape[0] - 1

    def reset(cp):
        rows = jnp.where(md.reset, md.slot, scratch)                     # [S]
        return cp[0].at[rows].set(0), cp[1].at[rows].set(False)

    counts, prompt = jax.lax.cond(jnp.any(md.reset), reset, lambda cp: cp, (counts, prompt))
    T = input_ids.shape[0]
    row = token_row
    tracked = (jnp.arange(T) < num_tokens) & md.track[row] & md.count_fed[row]   # [T]
    tslot = jnp.where(tracked, md.slot[row], scratch)                    # [T]
    in_prompt = positions < md.num_prompt[row]                           # [T]
    counts = counts.at[tslot, input_ids].add((tracked & ~in_prompt).astype(jnp.int32))
    prompt = prompt.at[tslot, input_ids].max(tracked & in_prompt)
    if md.count_extra.shape[1]:
        extra = md.count_extra                                           # [S, K]
        keep = md.track[:, None] & (extra >= 0)
        eslot = jnp.where(keep, md.slot[:, None], scratch)
        counts = counts.at[eslot, jnp.maximum(extra, 0)].add(keep.astype(jnp.int32))
    return SamplerState(counts=counts, prompt_mask=prompt, bias=state.bias)


def _penalized_rows(md: SamplingMetadata) -> jax.Array:
    """[S] bool: the rows that apply any penalty."""
    return md.track & ((md.repetition_penalty != 1.0) | (md.presence_penalty != 0.0)
                       | (md.frequency_penalty != 0.0))


def _penalize(x: jax.Array, md: SamplingMetadata, state: SamplerState, zero: jax.Array,
              penalized: jax.Array) -> jax.Array:
    """Repetition, frequency and presence penalties of the ``penalized`` [S] rows: x [S, V] -> [S, V]."""
    c = state.counts[md.slot]                                            # [S, V] i32
    if md.view_extra.shape[1]:
        # A verification row draws as if the proposals before it had been sampled.
        S, V = x.shape
        ids = jnp.where(md.view_extra >= 0, md.view_extra, V)            # [S, K], out of range: dropped
        c = c.at[jnp.arange(S)[:, None], ids].add(1, mode="drop")
    out = c > 0
    occurred = state.prompt_mask[md.slot] | out
    rep = md.repetition_penalty[:, None]
    # vLLM: positive logits are divided by the penalty, the others multiplied.
    xr = jnp.where(occurred, jnp.where(x > 0, x / rep, nx.barrier(x * rep, zero)), x)
    xf = xr - nx.barrier(md.frequency_penalty[:, None] * c.astype(jnp.float32), zero)
    xp = jnp.where(out, xf - md.presence_penalty[:, None], xf)
    return jnp.where(penalized[:, None], xp, x)


def _bias_suppress_penalize(x: jax.Array, md: SamplingMetadata, state: SamplerState, zero: jax.Array,
                            penalized: jax.Array) -> jax.Array:
    S, V = x.shape
    x = jnp.where(md.use_bias[:, None], x + state.bias[md.slot], x)
    ids = jnp.where(md.suppress >= 0, md.suppress, V)                    # out of range: dropped
    x = x.at[jnp.arange(S)[:, None], ids].set(NEG_INF, mode="drop")
    return jax.lax.cond(jnp.any(penalized), lambda x: _penalize(x, md, state, zero, penalized), lambda x: x, x)


def process_logits(logits: jax.Array, md: SamplingMetadata, state: SamplerState, zero: jax.Array) -> jax.Array:
    """Allowed / bad tokens, min_tokens, logit_bias, penalties: logits [S, V] -> [S, V].

    One ``lax.cond`` for all three (each materialises [S, V]), skipped when no row needs any."""
    penalized = _penalized_rows(md)                                      # [S]
    needed = jnp.any(md.use_bias) | jnp.any(md.suppress >= 0) | jnp.any(penalized)
    return jax.lax.cond(needed, lambda x: _bias_suppress_penalize(x, md, state, zero, penalized), lambda x: x,
                        logits)

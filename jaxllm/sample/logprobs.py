"""Logprobs: of the sampled tokens (:func:`sampled_logprobs`, after the draw) and of the prompt
tokens (:func:`prompt_logprobs`, in the step, vLLM's prompt_logprobs), both from one block
(:func:`logprob_block`): the top-k, the chosen token's value and its 1-based rank."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.sample.blocked import blocked_top_k, count_at_least


def logprob_block(lp: jax.Array, ids: jax.Array, k: int):
    """lp [N, V] (log)probabilities, ids [N] i32 chosen tokens, k >= 1 -> (chosen [N] f32,
    rank [N] i32 1-based, top ids [N, k] i32, top values [N, k] f32)."""
    top_lp, top_ids = blocked_top_k(lp, k)
    chosen = jnp.take_along_axis(lp, ids[:, None], axis=-1)[:, 0]
    rank = 1 + count_at_least(lp, jnp.nextafter(chosen, jnp.inf)).astype(jnp.int32)
    return chosen, rank, top_ids.astype(jnp.int32), top_lp


def empty_block(n: int, k: int):
    """The outputs of :func:`logprob_block` for ``n`` rows when none is asked for (zeros)."""
    return (jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.int32), jnp.zeros((n, k), jnp.int32),
            jnp.zeros((n, k), jnp.float32))


def _sampled_block(src: jax.Array, tokens: jax.Array, k: int, logprobs_mode: str):
    lp = jax.nn.log_softmax(src, axis=-1) if logprobs_mode.endswith("logprobs") else src
    return logprob_block(lp, tokens, k)


def sampled_logprobs(logits: jax.Array, processed: jax.Array | None, tokens: jax.Array, num_logprobs: jax.Array, *,
                     max_logprobs: int, logprobs_mode: str):
    """The sampled tokens' logprobs stage: logits [S, V] raw, ``processed`` [S, V] the drawn
    distribution (the processed modes; None otherwise), tokens [S], num_logprobs [S] (-1:
    none asked) -> :func:`logprob_block`'s outputs with k = max(max_logprobs, 1), computed only
    when a row asks.  ``logprobs_mode``: ``*_logprobs`` log-softmax, ``*_logits`` the values."""
    S = tokens.shape[0]
    K = max(max_logprobs, 1)
    if max_logprobs <= 0:
        return empty_block(S, K)
    src = logits if processed is None else processed
    return jax.lax.cond(jnp.any(num_logprobs >= 0), lambda: _sampled_block(src, tokens, K, logprobs_mode),
                        lambda: empty_block(S, K))


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
        return logprob_block(lp, jnp.maximum(t, 0), K)

    out = jax.lax.map(one, (hidden.reshape(T // chunk, chunk, -1), targets.reshape(T // chunk, chunk)))
    return tuple(o.reshape(T, *o.shape[2:]) for o in out)

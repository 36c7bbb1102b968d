"""The sampler of the compiled step: every row of the batch at once, greedy and random rows
in one executable, per-request parameters as ``[S]`` arrays.  :func:`sample` is the pipeline,
one stage module per step (vLLM v1's order):

1. ``processing.py``: allowed / bad tokens and logit_bias (the request's bias row),
   min_tokens and multi-token bad words (ids suppressed this step), penalties from the
   per-request counts of :class:`SamplerState` (kept by :func:`update_state`); then
   ``bitmask.py``: the grammar's allowed tokens (structured outputs, a ``[S, V/32]`` input).
2. ``draw.py``: greedy rows by argmax (lowest index among ties); random rows by
   ``truncation.py`` (temperature, min_p, top-k, top-p as one integer key per row), then a
   Gumbel-argmax draw whose noise is a pure function of (seed, output position, vocabulary
   index), see ``gumbel.py``; on XLA or as a Pallas kernel (``kernel_backend``).
3. ``logprobs.py``: the sampled tokens' logprobs, rank and top-k (raw or processed).

Every float that decides a token is computed with exactly rounded, contraction-proof
operations (``numerics.py``) and every reduction that decides one is order-independent
(max, integer sums, lowest-index tie-break, ``blocked.py``), so the draw equals the serial
host reference of ``reference.py`` bit for bit, whatever the batch row, the bucket or the
reduction order.

Speed on CPU, where XLA's ``argmax`` and ``sort`` are slow (a variadic reduce and a
comparator sort), comes from working in blocks of vocabulary entries (``blocked.py``): the
top-k / top-p thresholds and the draw look first at the few blocks with the largest maxima
(or noise bounds) and fall back to the whole row only when those cannot decide.  Branches
that no row needs this step (the random path, truncation, penalties, bias, logprobs, the
fallbacks) are skipped with ``lax.cond``, not compiled as variants; whatever a branch needs
is computed inside it, since a value a branch captures is computed whether it runs or not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config import LOGPROBS_MODES
from jaxllm.formats.gumbel import runtime_zero
from jaxllm.sample.arrays import SUPPRESS_WIDTH, SamplerOutput, SamplerState, SamplingMetadata
from jaxllm.sample.bitmask import apply_bitmask
from jaxllm.sample.draw import KERNEL_BACKENDS, draw_pallas, draw_xla
from jaxllm.sample.logprobs import prompt_logprobs, sampled_logprobs
from jaxllm.sample.processing import (init_state, process_logits, update_state, write_bias_row,
                                      write_penalty_row)

# The sampler's interface for the runner and the step (one import for all of it).
__all__ = ["KERNEL_BACKENDS", "accept", "LOGPROBS_MODES", "SUPPRESS_WIDTH", "SamplerOutput", "SamplerState", "SamplingMetadata",
           "init_state", "prompt_logprobs", "sample", "update_state", "write_bias_row",
           "write_penalty_row"]


def sample(logits: jax.Array, md: SamplingMetadata, state: SamplerState, allowed: jax.Array | None = None, *,
           max_logprobs: int,
           logprobs_mode: str = "raw_logprobs", fp64: bool = False, kernel_backend: str = "xla") -> SamplerOutput:
    """logits [S, V] float32 -> SamplerOutput (the state is read, not changed: see update_state).

    ``allowed``: [S, ceil(V / 32)] uint32 grammar bitmask (all ones: unconstrained), applied
    after processing, so before the draw and the processed logprobs (raw ones stay raw).
    ``kernel_backend``: ``xla`` (default) or ``pallas`` (the draw by the Pallas kernel, float32
    noise only; same tokens, see ``draw.draw_pallas``).  ``fp64``: float64 Gumbel noise."""
    if kernel_backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend={kernel_backend!r}: expected one of {KERNEL_BACKENDS}")
    if kernel_backend == "pallas" and fp64:
        raise ValueError("kernel_backend='pallas' draws with float32 noise only; "
                         "fp64 Gumbel needs kernel_backend='xla'")
    zero = runtime_zero(md.out_pos)                                      # [S, 1]
    processed_mode = logprobs_mode.startswith("processed") and max_logprobs > 0
    x = process_logits(logits, md, state, zero)                          # [S, V]
    if allowed is not None:
        x = apply_bitmask(x, allowed)                                    # [S, V]
    if kernel_backend == "pallas":
        tokens, processed = draw_pallas(x, md, zero, processed_mode)     # [S], [S, V] or None
    else:
        tokens, processed = draw_xla(x, md, zero, fp64, processed_mode)
    chosen, rank, top_ids, top_lp = sampled_logprobs(logits, processed, tokens, md.num_logprobs,
                                                     max_logprobs=max_logprobs, logprobs_mode=logprobs_mode)
    return SamplerOutput(tokens, chosen, rank, top_ids, top_lp, accept(tokens, md))


def accept(tokens: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Speculative acceptance: tokens [S] as drawn -> [S] bool, whether each row's token is an
    output.  A proposal is accepted exactly when it equals the token drawn at its position from
    the target's own logits and the noise plain decoding uses there, so a row's token is an
    output when every proposal of its request before it was accepted; the first row that
    rejects still emits its own token (the correction), and a fully accepted run ends with the
    last row's token (the bonus).  Output = plain decoding's, token for token, at any
    temperature (rows outside a verification are their own group: always emitted)."""
    rejects = ((md.draft_next >= 0) & (tokens != md.draft_next)).astype(jnp.int32)   # [S]
    before = jnp.cumsum(rejects) - rejects                               # [S] rejections in rows < r
    return before == before[md.group_start]

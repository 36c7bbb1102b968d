"""The sampler's device-side data: a step's per-row parameters (:class:`SamplingMetadata`), the
per-request state the sampler reads (:class:`SamplerState`) and what it returns
(:class:`SamplerOutput`).  Every stage module of the sampler takes these; the host side that
fills them is ``metadata.py``."""

from __future__ import annotations

from dataclasses import dataclass

import jax

SUPPRESS_WIDTH = 128
"""Ids one row may suppress in one step (min_tokens stop ids + multi-token bad words), like
vLLM's MAX_NUM_STOP_TOKEN_IDS."""


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
    # Speculative decoding (spec_decode/): a request verifying k proposals has k + 1 consecutive rows,
    # row j drawing output position out_pos + j as if proposals 1..j had been sampled.  Without
    # speculation every row is its own group and the draft arrays are [S, 0].
    count_fed: jax.Array           # [S] bool, count the token this row feeds (False: a proposal)
    count_extra: jax.Array         # [S, K] i32, accepted proposals of the last step, counted now; -1: none
    view_extra: jax.Array          # [S, K] i32, proposals before this row, counted for its draw only
    draft_next: jax.Array          # [S] i32, the proposal this row's draw must equal for the next row, -1: none
    group_start: jax.Array         # [S] i32, the request's first row


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
    emitted: jax.Array          # [S] bool, the row's token is an output (every earlier proposal of its request accepted)

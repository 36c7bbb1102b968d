"""A step's inputs on the host: one ``SchedulerOutput`` and the requests' state ->
an immutable :class:`PreparedStep` of numpy arrays padded to the step's bucket (T, S).

Batch rows are rebuilt every step in the scheduler's order; padding tokens write into the
null block 0 and padding rows sample into the sampler state's scratch row.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.layers.attention import AttentionMetadata
from jaxllm.outputs import SchedulerOutput
from jaxllm.runner.requests import RequestStates
from jaxllm.runner.step import StepInputs
from jaxllm.runner.step_config import StepConfig
from jaxllm.sample import metadata as smd
from jaxllm.sample.sampler import SamplingMetadata


@dataclass(frozen=True)
class PreparedStep:
    bucket: tuple[int, int]
    inputs: StepInputs
    """numpy arrays, padded to ``bucket``."""
    req_ids: tuple[str, ...]
    """Batch row -> request id (real rows only)."""
    samples: tuple[bool, ...]
    """Per row: whether it samples a token (False for a prefill chunk that is not the last)."""
    prompt_plan: tuple[tuple[str, int, int], ...]
    """(request id, first flat token, count) of the positions whose prompt logprobs this step
    computes."""


def prepare(so: SchedulerOutput, states: RequestStates, cfg: StepConfig, bucket: tuple[int, int]) -> PreparedStep:
    """``bucket``: the step's (T, S), picked by the caller (runner/buckets.pick).  Also tells
    the sampler rows which requests take their first step (``states.rows``)."""
    rows = list(so.num_scheduled_tokens.items())
    S = len(rows)
    Tb, Sb = bucket
    BS = cfg.block_size
    input_ids = np.zeros(Tb, np.int32)
    positions = np.zeros(Tb, np.int32)
    slots = np.zeros(Tb, np.int32)   # padding tokens write into the null block 0
    token_seq = np.zeros(Tb, np.int32)
    tables = np.zeros((Sb, cfg.max_blocks_per_seq), np.int32)
    seq_lens = np.zeros(Sb, np.int32)
    qsl = np.zeros(Sb + 1, np.int32)
    logits_idx = np.zeros(Sb, np.int32)
    prompt_targets = np.full(Tb, -1, np.int32)
    md = smd.empty_metadata(Sb)
    md["slot"][:] = states.rows.scratch
    samples, plan = [], []
    off = 0
    for i, (rid, n) in enumerate(rows):
        st = states[rid]
        c = st.num_computed_tokens
        pos = np.arange(c, c + n, dtype=np.int32)
        blocks = np.asarray(st.block_ids, np.int32)
        input_ids[off:off + n] = st.token_ids[c:c + n]
        positions[off:off + n] = pos
        slots[off:off + n] = blocks[pos // BS] * BS + pos % BS
        token_seq[off:off + n] = i
        tables[i, :len(blocks)] = blocks
        seq_lens[i] = c + n
        if st.prompt_lps is not None and c < st.num_prompt_tokens - 1:
            m = min(c + n, st.num_prompt_tokens - 1) - c   # positions whose next token is a prompt token
            prompt_targets[off:off + m] = st.token_ids[c + 1:c + 1 + m]
            plan.append((rid, off, m))
        off += n
        qsl[i + 1] = off
        logits_idx[i] = off - 1
        samples.append(c + n == len(st.token_ids))
        p = st.sampling
        # Only min_tokens and multi-token bad words look at the outputs: no per-step copy otherwise.
        needs_outputs = samples[-1] and (p.min_tokens > 0 or p.bad_word_seqs)
        reset = states.rows.first_step(rid, p, st.token_ids, st.num_prompt_tokens, c)
        smd.fill_row(md, i, p, slot=states.rows.row(rid), out_pos=len(st.token_ids) - st.num_prompt_tokens,
                     num_prompt=st.num_prompt_tokens, reset=reset,
                     suppress=p.suppressed(st.token_ids[st.num_prompt_tokens:]) if needs_outputs else [],
                     num_logprobs=p.num_logprobs if samples[-1] else -1)
    qsl[S + 1:] = off
    inputs = StepInputs(
        input_ids=input_ids,
        attn=AttentionMetadata(positions=positions, slot_mapping=slots, token_seq=token_seq,
                               block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl),
        logits_indices=logits_idx,
        sampling=smd.to_metadata(md),
        prompt_targets=prompt_targets)
    return PreparedStep(bucket=(Tb, Sb), inputs=inputs, req_ids=tuple(r for r, _ in rows), samples=tuple(samples),
                        prompt_plan=tuple(plan))


def sampling_spec(S: int, sharding) -> SamplingMetadata:
    return smd.to_metadata({k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
                            for k, v in smd.empty_metadata(S).items()})


def input_spec(cfg: StepConfig, T: int, S: int, sharding) -> StepInputs:
    """The shapes of :func:`prepare`'s inputs for bucket (T, S), for ahead-of-time lowering."""
    def sds(shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)

    return StepInputs(
        input_ids=sds((T,)),
        attn=AttentionMetadata(positions=sds((T,)), slot_mapping=sds((T,)), token_seq=sds((T,)),
                               block_tables=sds((S, cfg.max_blocks_per_seq)), seq_lens=sds((S,)),
                               query_start_loc=sds((S + 1,))),
        logits_indices=sds((S,)),
        sampling=sampling_spec(S, sharding),
        prompt_targets=sds((T,)))

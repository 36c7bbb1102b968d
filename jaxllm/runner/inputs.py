"""A step's inputs on the host: the scheduled sequences (a ``SchedulerOutput``'s, or a draft
model's) and the requests' state -> an immutable :class:`PreparedStep` of numpy arrays padded
to the step's bucket (T, S).

Batch rows are rebuilt every step in the scheduler's order; padding tokens write into the
null block 0 and padding rows sample into the sampler state's scratch row.
"""

from __future__ import annotations

import functools
import itertools
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
    """Sequence -> request id, in the scheduler's order (real sequences only)."""
    samples: tuple[bool, ...]
    """Per sequence: whether it samples (False for a prefill chunk that is not the last)."""
    prompt_plan: tuple[tuple[str, int, int], ...]
    """(request id, first flat token, count) of the positions whose prompt logprobs this step
    computes."""
    drafts: tuple[tuple[int, ...], ...] = ()
    """Per sequence: the proposals it verifies this step (empty: a plain step)."""
    feed: np.ndarray | None = None
    """[T] int32, async scheduling: per input token, the sampler row slot whose last sampled
    token (still on the device) it is, -1 for a host-known id; None when every id is known."""

    @functools.cached_property
    def first_row(self) -> tuple[int, ...]:
        """Per sequence: its first sampling row (a verification has 1 + len(drafts) rows)."""
        return tuple(itertools.accumulate((1 + len(d) for d in self.drafts), initial=0))[:-1]

    def rows(self):
        """(sampling row, request id, draft index j) of every row that samples: row j of a
        verification draws as if the request's first j proposals had been sampled."""
        for i, rid in enumerate(self.req_ids):
            if self.samples[i]:
                for j in range(1 + len(self.drafts[i])):
                    yield self.first_row[i] + j, rid, j


def num_rows(so: SchedulerOutput) -> int:
    """Sampling rows the step of ``so`` needs: one per sequence, plus one per proposal."""
    return len(so.num_scheduled_tokens) + sum(len(d) for d in so.scheduled_spec_decode_tokens.values())


def prepare_sequences(seqs: list[tuple[str, int]], spec: dict[str, list[int]], states: RequestStates,
                      cfg: StepConfig, bucket: tuple[int, int]) -> PreparedStep:
    """The inputs of a step of ``seqs`` ((request id, tokens to compute) in the batch's order)
    verifying ``spec`` (request id -> proposals), read from each request's state in ``states``
    (tokens, computed count, block table).  ``bucket``: the step's (T, S), picked by the caller
    (runner/buckets.pick).  Also tells the sampler rows which requests take their first step
    (``states.rows``).  The target's step passes its ``SchedulerOutput``'s; a draft model's step
    (spec_decode/draft_model.py) its own states on the target's block tables, and no proposals.

    A request verifying proposals d_1..d_k feeds its last token and the k proposals as one
    sequence, and takes k + 1 sampling rows: row j draws after token j, at output position
    out_pos + j, with min_tokens, bad words and penalties applied as if d_1..d_j had been
    sampled (sample/arrays.py)."""
    Tb, Sb = bucket
    BS = cfg.block_size
    K = cfg.num_speculative_tokens
    input_ids = np.zeros(Tb, np.int32)
    positions = np.zeros(Tb, np.int32)
    slots = np.zeros(Tb, np.int32)   # padding tokens write into the null block 0
    token_seq = np.zeros(Tb, np.int32)
    token_row = np.zeros(Tb, np.int32)
    tables = np.zeros((Sb, cfg.max_blocks_per_seq), np.int32)
    seq_lens = np.zeros(Sb, np.int32)
    qsl = np.zeros(Sb + 1, np.int32)
    logits_idx = np.zeros(Sb, np.int32)
    prompt_targets = np.full(Tb, -1, np.int32)
    md = smd.empty_metadata(Sb, K)
    md["slot"][:] = states.rows.scratch
    # Per-sequence state slots (a hybrid model's): padding sequences take an out-of-range one.
    state_slots = np.full(Sb, 0 if states.slots is None else states.slots.padding, np.int32)
    feed = np.full(Tb, -1, np.int32)
    lora_slots = np.full(Tb, -1, np.int32) if cfg.max_loras else None   # padding: no adapter
    samples, plan, drafts_of = [], [], []
    off = r = 0
    for i, (rid, n) in enumerate(seqs):
        st = states[rid]
        c = st.num_computed_tokens
        drafts = tuple(spec.get(rid, ()))
        pos = np.arange(c, c + n, dtype=np.int32)
        blocks = np.asarray(st.block_ids, np.int32)
        known = len(st.token_ids)
        if c + n - len(drafts) > known:
            # Async scheduling: the ids past the known ones were sampled by the step still
            # running; they are fed on the device from this request's sampler slot.
            if drafts or c + n > known + st.inflight:
                raise ValueError(f"request {rid}: {c + n - known} tokens to compute are not known")
            input_ids[off:off + known - c] = st.token_ids[c:known]
            feed[off + known - c:off + n] = states.rows.row(rid)
        else:
            input_ids[off:off + n] = (st.token_ids[c:c + n] if not drafts else [st.token_ids[c], *drafts])
        positions[off:off + n] = pos
        slots[off:off + n] = blocks[pos // BS] * BS + pos % BS
        token_seq[off:off + n] = i
        if lora_slots is not None:
            lora_slots[off:off + n] = st.lora_slot
        token_row[off:off + n] = r
        tables[i, :len(blocks)] = blocks
        if states.slots is not None:
            state_slots[i] = states.slots.slot(rid)
        seq_lens[i] = c + n
        if st.prompt_lps is not None and c < st.num_prompt_tokens - 1:
            m = min(c + n, st.num_prompt_tokens - 1) - c   # positions whose next token is a prompt token
            prompt_targets[off:off + m] = st.token_ids[c + 1:c + 1 + m]
            plan.append((rid, off, m))
        total = len(st.token_ids) + st.inflight
        sampled = c + n - len(drafts) == total
        samples.append(sampled)
        drafts_of.append(drafts)
        p = st.sampling
        # Only min_tokens and multi-token bad words look at the outputs: no per-step copy otherwise.
        needs_outputs = sampled and (p.min_tokens > 0 or p.bad_word_seqs)
        if needs_outputs and st.inflight:
            raise ValueError(f"request {rid}: min_tokens and multi-token bad words need its last token on the host")
        outputs = st.token_ids[st.num_prompt_tokens:] if needs_outputs else None
        reset = states.rows.first_step(rid, p, st.token_ids, st.num_prompt_tokens, c)
        slot = states.rows.row(rid)
        out_pos = total - st.num_prompt_tokens
        pending = st.take_pending_counts() if p.uses_penalties else ()
        if pending:
            md["count_extra"][r, :len(pending)] = pending
        for j in range(1 + len(drafts)):
            row = r + j
            smd.fill_row(md, row, p, slot=slot, out_pos=out_pos + j, num_prompt=st.num_prompt_tokens, reset=reset,
                         suppress=p.suppressed([*outputs, *drafts[:j]]) if needs_outputs else [],
                         num_logprobs=p.num_logprobs if sampled else -1)
            reset = False
            logits_idx[row] = off + n - 1 - len(drafts) + j
            if drafts:
                token_row[off + j] = row
                md["group_start"][row] = r
                md["count_fed"][row] = j == 0
                md["view_extra"][row, :j] = drafts[:j]
                md["draft_next"][row] = drafts[j] if j < len(drafts) else -1
        off += n
        r += 1 + len(drafts)
        qsl[i + 1] = off
    qsl[len(seqs) + 1:] = off
    images = _image_inputs(seqs, states, positions, cfg) if cfg.images else {}
    rope = rope_positions(seqs, states, positions) if cfg.mrope else None
    inputs = StepInputs(
        input_ids=input_ids,
        attn=AttentionMetadata(positions=positions, slot_mapping=slots, token_seq=token_seq,
                               block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl,
                               visible_upto=images.get("visible")),
        logits_indices=logits_idx,
        token_row=token_row,
        sampling=smd.to_metadata(md),
        prompt_targets=prompt_targets,
        state_slots=state_slots,
        lora_slots=lora_slots,
        lora_used=None if lora_slots is None else used_slots(lora_slots, cfg.max_loras),
        image_row=images.get("row"), image_embeds=images.get("embeds"), rope_positions=rope)
    return PreparedStep(bucket=(Tb, Sb), inputs=inputs, req_ids=tuple(rid for rid, _ in seqs), samples=tuple(samples),
                        prompt_plan=tuple(plan), drafts=tuple(drafts_of),
                        feed=feed if (feed >= 0).any() else None)


def _image_inputs(seqs: list[tuple[str, int]], states: RequestStates, positions: np.ndarray,
                  cfg: StepConfig) -> dict[str, np.ndarray]:
    """A vision-language step's image inputs: each token's ``visible_upto`` [T] (its own
    position, or its image's last for an image token), ``row`` [T] and ``embeds`` [T, D] (the
    encoder's row at each image token).  The scheduler never ends a chunk inside an image."""
    T = len(positions)
    visible = positions.copy()
    row = np.full(T, -1, np.int32)
    embeds = None    # [T, D] made only for a step with image tokens (a text-only step: None)
    off = 0
    for rid, n in seqs:
        im = states[rid].images
        if im is not None:
            pos = positions[off:off + n]
            p = pos[pos < len(im.row)]                                       # prompt positions in this chunk
            visible[off:off + len(p)] = im.visible[p]
            r = im.row[p]
            at = off + np.nonzero(r >= 0)[0]
            if len(at):
                if embeds is None:
                    embeds = np.zeros((T, cfg.arch.hidden_size), np.float32)
                row[at] = at
                embeds[at] = im.embeds[r[r >= 0]]
        off += n
    return {"visible": visible, "row": row, "embeds": embeds}


def rope_positions(seqs: list[tuple[str, int]], states: RequestStates, positions: np.ndarray) -> np.ndarray:
    """A step's M-RoPE positions int32 [3, T]: a prompt token of a request with images takes its
    column of the request's precomputed positions (``request.MRope``), any later token (a
    decode) its sequence index + the request's delta in all three streams; a text-only
    request's and padding tokens, the sequence index."""
    rope = np.broadcast_to(positions, (3, len(positions))).copy()           # [3, T]
    off = 0
    for rid, n in seqs:
        m = states[rid].mrope
        if m is not None:
            pos = positions[off:off + n]                                     # this chunk's positions
            P = m.positions.shape[1]
            prompt = pos < P
            rope[:, off:off + n] = np.where(prompt[None], m.positions[:, np.minimum(pos, P - 1)], pos + m.delta)
        off += n
    return rope


def sampling_spec(S: int, sharding, draft_width: int = 0) -> SamplingMetadata:
    return smd.to_metadata({k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
                            for k, v in smd.empty_metadata(S, draft_width).items()})


def input_spec(cfg: StepConfig, T: int, S: int, sharding) -> StepInputs:
    """The shapes of :func:`prepare`'s inputs for bucket (T, S), for ahead-of-time lowering."""
    def sds(shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)

    return StepInputs(
        input_ids=sds((T,)),
        attn=AttentionMetadata(positions=sds((T,)), slot_mapping=sds((T,)), token_seq=sds((T,)),
                               block_tables=sds((S, cfg.max_blocks_per_seq)), seq_lens=sds((S,)),
                               query_start_loc=sds((S + 1,)), visible_upto=sds((T,)) if cfg.images else None),
        logits_indices=sds((S,)),
        token_row=sds((T,)),
        sampling=sampling_spec(S, sharding, cfg.num_speculative_tokens),
        prompt_targets=sds((T,)),
        state_slots=sds((S,)),
        lora_slots=sds((T,)) if cfg.max_loras else None,
        lora_used=sds((cfg.max_loras,)) if cfg.max_loras else None,
        image_row=sds((T,)) if cfg.images else None,
        image_embeds=None,    # not packed: the step's own argument (image_rows_spec)
        rope_positions=sds((3, T)) if cfg.mrope else None)


def image_rows_spec(cfg: StepConfig, T: int, sharding) -> jax.ShapeDtypeStruct | None:
    """A vision-language step's image rows [T, D] float32, an argument of their own beside the
    packed words: a text-only step passes a zero buffer kept on the device instead of sending
    T x D floats (5 MiB for a 512-token step at D 2560) every step."""
    return jax.ShapeDtypeStruct((T, cfg.arch.hidden_size), jnp.float32, sharding=sharding) if cfg.images else None


def used_slots(lora_slots: np.ndarray, max_loras: int) -> np.ndarray:
    """[T] each token's LoRA slot (-1: none) -> [max_loras] int32: the distinct slots the step
    uses, then -1s.  The step reads only these slots' matrices (lora/apply.py), so its cost
    follows the adapters in the batch, not ``max_loras``."""
    used = np.full(max_loras, -1, np.int32)
    distinct = np.unique(lora_slots[lora_slots >= 0])
    used[:len(distinct)] = distinct
    return used

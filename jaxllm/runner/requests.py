"""The runner's per-request host state, keyed by request id: tokens, block table,
sampling parameters; kept in step with each ``SchedulerOutput`` and with the tokens each
step samples, which it also turns into the ``RunnerOutput`` (logprobs as arrays)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxllm.outputs import LogprobsArrays, NewRequestData, RunnerOutput, SchedulerOutput
from jaxllm.runner.state_slots import StateSlots
from jaxllm.sample.metadata import RowParams
from jaxllm.sample.states import SamplerRows
from jaxllm.sampling_params import SamplingParams


@dataclass
class RequestState:
    token_ids: list[int]
    """Prompt and sampled tokens: the step reads its inputs from here."""
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: RowParams
    prompt_lps: list[LogprobsArrays] | None = None
    """prompt_logprobs gathered chunk by chunk, delivered with the first sampled token."""
    params: SamplingParams | None = None
    """As the engine sent them, with the request's resolved ``seed``: what a draft model
    samples with (spec_decode/draft_model.py)."""
    seed: int = 0
    pending_counts: list[int] | None = None
    """Proposals the last verification accepted: fed uncounted, the penalty counts take them
    in the request's next step (sample/processing.update_state)."""
    inflight: int = 0
    """Async scheduling: tokens a dispatched step samples for it that are not in ``token_ids``
    yet (0 or 1); the next step takes such a token on the device (runner/token_feed.py)."""
    lora_slot: int = -1
    """The device slot of its LoRA adapter (-1: the base model)."""
    images: object | None = None
    """A vision-language model's request with images: its encoded ``runner.vision.RequestImages``
    (set by the runner when the request is seated)."""
    mrope: object | None = None
    """A Qwen prompt with images: its ``request.MRope`` (the step's ``rope_positions``,
    runner/inputs.py); None: every stream is the sequence index."""
    pool_sum: np.ndarray | None = None
    """MEAN pooling: the sum of its prompt's hidden states over the chunks run so far [D]."""

    def take_pending_counts(self) -> list[int]:
        out, self.pending_counts = self.pending_counts or [], None
        return out

    @classmethod
    def from_new(cls, nr: NewRequestData, vocab_size: int) -> "RequestState":
        p = RowParams.from_sampling_params(nr.sampling_params, nr.seed, vocab_size)
        # A request resumed after preemption has delivered its prompt logprobs already.
        wants_plp = p.num_prompt_logprobs >= 0 and len(nr.token_ids) == nr.num_prompt_tokens
        return cls(token_ids=list(nr.token_ids), num_prompt_tokens=nr.num_prompt_tokens,
                   block_ids=list(nr.block_ids), num_computed_tokens=nr.num_computed_tokens,
                   sampling=p, prompt_lps=[] if wants_plp else None, params=nr.sampling_params, seed=nr.seed,
                   lora_slot=nr.lora_slot, mrope=nr.mrope)


@dataclass(frozen=True)
class SampledStep:
    """A step's results on the host, in batch-row order (padding rows included)."""

    token_ids: np.ndarray        # [S] i32
    logprob: np.ndarray          # [S] f32, of the sampled token
    rank: np.ndarray             # [S] i32
    top_ids: np.ndarray          # [S, K] i32
    top_logprobs: np.ndarray     # [S, K] f32
    emitted: np.ndarray          # [S] bool, the row's token is an output (sampler.accept)
    prompt: tuple | None = None
    """(logprob [T], rank [T], top ids [T, K], top logprobs [T, K]) when a row asked for
    prompt logprobs this step."""
    pooled: np.ndarray | None = None
    """[S, D] float32, a pooling engine's step: per sequence, its last token's hidden state
    (LAST) or the sum over its tokens of the step (MEAN); ``RequestStates.pooling_type`` says which."""


class RequestStates:
    def __init__(self, vocab_size: int, sampler_rows: SamplerRows, state_slots: StateSlots | None = None,
                 pooling_type: str = ""):
        """``state_slots``: the per-sequence state slots of a model that has some, else None;
        ``pooling_type``: a pooling engine's (``StepConfig.pooling_type``), "" for generation."""
        self.vocab_size = vocab_size
        self.pooling_type = pooling_type
        self.rows = sampler_rows
        self.slots = state_slots
        self._states: dict[str, RequestState] = {}

    def __getitem__(self, req_id: str) -> RequestState:
        return self._states[req_id]

    def update(self, so: SchedulerOutput) -> None:
        """Drops ended requests, adds new (or resumed) ones, applies the per-step diffs."""
        for rid in so.finished_req_ids:
            self.drop(rid)
        for nr in so.scheduled_new_reqs:
            self.seat(nr.req_id, RequestState.from_new(nr, self.vocab_size))
        c = so.scheduled_cached_reqs
        for rid, blocks, n in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            st = self._states[rid]
            st.block_ids.extend(blocks)
            st.num_computed_tokens = n

    def seat(self, req_id: str, st: RequestState) -> None:
        """Adds a request (new, resumed, or sent again in full) with a fresh sampler row."""
        self._states[req_id] = st
        self.rows.add_request(req_id, st.sampling)
        if self.slots is not None:
            # A request seen again after preemption comes back from position 0: the step
            # zeroes the slot's state before its first token (models/qwen3_next/).
            self.slots.add(req_id)

    def drop(self, req_id: str) -> None:
        """Forgets an ended (or preempted) request; an unknown id is ignored."""
        if self._states.pop(req_id, None) is not None:
            self.rows.remove_request(req_id)
            if self.slots is not None:
                self.slots.remove(req_id)

    def snapshot(self, req_ids) -> dict[str, RequestState]:
        """The states of ``req_ids`` as objects: what a dispatched step's results are recorded
        into, even if a later step's update drops the request from this table first."""
        return {rid: self._states[rid] for rid in req_ids}

    def record(self, step, out: SampledStep, states: dict[str, RequestState] | None = None) -> RunnerOutput:
        """Appends each sampling request's output tokens (its row's, or for a verification the
        rows the sampler emitted) to its request and assembles the step's output.  ``states``:
        the step's request states (:meth:`snapshot`; None: the current ones)."""
        states = self._states if states is None else states
        pooled = {} if out.pooled is None else self._pool(step, out.pooled, states)
        if out.prompt is not None:
            self._gather_prompt_logprobs(step.prompt_plan, step.inputs.prompt_targets, out.prompt, states)
        sampled: list[list[int]] = []
        logprobs: dict[str, LogprobsArrays] = {}
        prompt_out: dict[str, LogprobsArrays] = {}
        for i, rid in enumerate(step.req_ids):
            if not step.samples[i]:
                sampled.append([])
                continue
            st = states[rid]
            r0, drafts = step.first_row[i], step.drafts[i]
            n = 1 + len(drafts)
            if drafts:
                # The emitted rows are a prefix of the request's rows (sampler.accept).
                n = int(np.argmin(np.append(out.emitted[r0:r0 + n], False)))
                if n > 1 and st.sampling.uses_penalties:
                    st.pending_counts = list(drafts[:n - 1])
            rows = slice(r0, r0 + n)
            toks = [int(t) for t in out.token_ids[rows]]
            st.token_ids.extend(toks)
            st.inflight = max(0, st.inflight - 1)
            sampled.append(toks)
            k = st.sampling.num_logprobs
            if k >= 0:
                logprobs[rid] = LogprobsArrays(
                    np.concatenate([out.token_ids[rows, None], out.top_ids[rows, :k]], axis=1),
                    np.concatenate([out.logprob[rows, None], out.top_logprobs[rows, :k]], axis=1), out.rank[rows])
            if st.prompt_lps is not None and len(st.token_ids) > st.num_prompt_tokens:
                prompt_out[rid] = LogprobsArrays.concat(st.prompt_lps, st.sampling.num_prompt_logprobs)
                st.prompt_lps = None
        return RunnerOutput(req_ids=list(step.req_ids), sampled_token_ids=sampled, logprobs=logprobs,
                            prompt_logprobs=prompt_out, pooled=pooled)

    def _pool(self, step, rows: np.ndarray, states) -> dict[str, np.ndarray]:
        """A pooling step's rows [S, D] -> the pooled vector [D] of each request whose last prompt
        chunk ran (MEAN: the chunks' sums added up, divided by the prompt's length)."""
        done = {}
        for i, rid in enumerate(step.req_ids):
            st = states[rid]
            if self.pooling_type == "MEAN":
                st.pool_sum = rows[i] if st.pool_sum is None else st.pool_sum + rows[i]
            if step.samples[i]:   # its last chunk: the step "samples" after it
                done[rid] = (rows[i] if self.pooling_type == "LAST" else
                             (st.pool_sum / st.num_prompt_tokens).astype(np.float32))
        return done

    def _gather_prompt_logprobs(self, plan, targets: np.ndarray, plp, states) -> None:
        """Appends this step's prompt logprobs to each asking request's list."""
        lp, rank, top_ids, top_lp = plp
        for rid, start, count in plan:
            st = states[rid]
            k = st.sampling.num_prompt_logprobs
            rows = slice(start, start + count)
            st.prompt_lps.append(LogprobsArrays(
                np.concatenate([targets[rows, None], top_ids[rows, :k]], axis=1),
                np.concatenate([lp[rows, None], top_lp[rows, :k]], axis=1), rank[rows]))

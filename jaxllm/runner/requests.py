"""The runner's per-request host state, keyed by request id: tokens, block table,
sampling parameters; kept in step with each ``SchedulerOutput`` and with the tokens each
step samples, which it also turns into the ``RunnerOutput`` (logprobs as arrays)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxllm.outputs import LogprobsArrays, NewRequestData, RunnerOutput, SchedulerOutput
from jaxllm.sample.metadata import RowParams
from jaxllm.sample.states import SamplerRows


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

    @classmethod
    def from_new(cls, nr: NewRequestData, vocab_size: int) -> "RequestState":
        p = RowParams.from_sampling_params(nr.sampling_params, nr.seed, vocab_size)
        # A request resumed after preemption has delivered its prompt logprobs already.
        wants_plp = p.num_prompt_logprobs >= 0 and len(nr.token_ids) == nr.num_prompt_tokens
        return cls(token_ids=list(nr.token_ids), num_prompt_tokens=nr.num_prompt_tokens,
                   block_ids=list(nr.block_ids), num_computed_tokens=nr.num_computed_tokens,
                   sampling=p, prompt_lps=[] if wants_plp else None)


@dataclass(frozen=True)
class SampledStep:
    """A step's results on the host, in batch-row order (padding rows included)."""

    token_ids: np.ndarray        # [S] i32
    logprob: np.ndarray          # [S] f32, of the sampled token
    rank: np.ndarray             # [S] i32
    top_ids: np.ndarray          # [S, K] i32
    top_logprobs: np.ndarray     # [S, K] f32
    prompt: tuple | None = None
    """(logprob [T], rank [T], top ids [T, K], top logprobs [T, K]) when a row asked for
    prompt logprobs this step."""


class RequestStates:
    def __init__(self, vocab_size: int, sampler_rows: SamplerRows):
        self.vocab_size = vocab_size
        self.rows = sampler_rows
        self._states: dict[str, RequestState] = {}

    def __getitem__(self, req_id: str) -> RequestState:
        return self._states[req_id]

    def update(self, so: SchedulerOutput) -> None:
        """Drops ended requests, adds new (or resumed) ones, applies the per-step diffs."""
        for rid in so.finished_req_ids:
            if self._states.pop(rid, None) is not None:
                self.rows.remove_request(rid)
        for nr in so.scheduled_new_reqs:
            st = self._states[nr.req_id] = RequestState.from_new(nr, self.vocab_size)
            self.rows.add_request(nr.req_id, st.sampling)
        c = so.scheduled_cached_reqs
        for rid, blocks, n in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            st = self._states[rid]
            st.block_ids.extend(blocks)
            st.num_computed_tokens = n

    def record(self, req_ids: tuple[str, ...], samples: tuple[bool, ...], prompt_plan, prompt_targets: np.ndarray,
               out: SampledStep) -> RunnerOutput:
        """Appends each sampling row's token to its request and assembles the step's output."""
        if out.prompt is not None:
            self._gather_prompt_logprobs(prompt_plan, prompt_targets, out.prompt)
        sampled: list[list[int]] = []
        logprobs: dict[str, LogprobsArrays] = {}
        prompt_out: dict[str, LogprobsArrays] = {}
        for i, rid in enumerate(req_ids):
            if not samples[i]:
                sampled.append([])
                continue
            st = self._states[rid]
            tok = int(out.token_ids[i])
            st.token_ids.append(tok)
            sampled.append([tok])
            k = st.sampling.num_logprobs
            if k >= 0:
                logprobs[rid] = LogprobsArrays(
                    np.concatenate([out.token_ids[i:i + 1], out.top_ids[i, :k]])[None],
                    np.concatenate([out.logprob[i:i + 1], out.top_logprobs[i, :k]])[None], out.rank[i:i + 1])
            if st.prompt_lps is not None and len(st.token_ids) == st.num_prompt_tokens + 1:
                prompt_out[rid] = LogprobsArrays.concat(st.prompt_lps, st.sampling.num_prompt_logprobs)
                st.prompt_lps = None
        return RunnerOutput(req_ids=list(req_ids), sampled_token_ids=sampled, logprobs=logprobs,
                            prompt_logprobs=prompt_out)

    def _gather_prompt_logprobs(self, plan, targets: np.ndarray, plp) -> None:
        """Appends this step's prompt logprobs to each asking request's list."""
        lp, rank, top_ids, top_lp = plp
        for rid, start, count in plan:
            st = self._states[rid]
            k = st.sampling.num_prompt_logprobs
            rows = slice(start, start + count)
            st.prompt_lps.append(LogprobsArrays(
                np.concatenate([targets[rows, None], top_ids[rows, :k]], axis=1),
                np.concatenate([lp[rows, None], top_lp[rows, :k]], axis=1), rank[rows]))

"""Boundary types: the only objects that cross from one layer of the engine to the next.

scheduler -> runner:           ``SchedulerOutput`` (new requests in full, then per-step diffs,
                               and the step's ``SchedulingEvent``s)
runner -> scheduler:           ``RunnerOutput`` (token lists and logprob arrays, keyed by request id)
engine core -> output proc.:   ``EngineCoreOutputs`` (``EngineCoreOutput`` per request, and the events)
engine -> API layer / user:    ``RequestOutput`` with ``CompletionOutput`` (vLLM's shape)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxllm.sampling_params import SamplingParams


# ---------------------------------------------------------------- scheduler -> runner

@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen (or sees again after preemption): sent in full."""

    req_id: str
    token_ids: list[int]
    """Prompt plus any tokens already sampled (a resumed request recomputes them)."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    """The request's resolved 64-bit seed."""
    block_ids: list[int]
    num_computed_tokens: int
    lora_slot: int = -1
    """The device slot of its LoRA adapter (-1: the base model)."""
    images: tuple = ()
    """Its ``request.ImageInput``s (a vision-language engine's runner encodes them)."""
    mrope: object | None = None
    """Its ``request.MRope`` (a Qwen prompt with images), or None."""


@dataclass(frozen=True)
class CachedRequestData:
    """Per-step diffs for requests the runner already holds."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


class EventKind:
    """What a :class:`SchedulingEvent` says happened (vLLM's ``EngineCoreEventType`` names)."""

    SCHEDULED = "scheduled"
    """Admitted from the waiting queue (first admission, or again after a preemption)."""
    PREEMPTED = "preempted"


@dataclass(frozen=True)
class SchedulingEvent:
    """The scheduler's stamp on a request (vLLM's ``Request.record_event``), reported in its
    output so that metrics need not poll the scheduler's state."""

    request_id: str
    kind: str
    """An :class:`EventKind` value."""
    timestamp: float
    """``time.monotonic()``, the clock of ``EngineRequest.arrival_time``."""


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """Tokens each request computes this step (a prefill chunk, or 1 for a decode)."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    """Requests that ended (finished, aborted or preempted) since the last step: the runner drops them."""
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: the proposals each decoding request verifies this step (its
    ``num_scheduled_tokens`` counts them: 1 + len)."""
    events: list[SchedulingEvent] = field(default_factory=list)
    """What happened to requests while this step was scheduled (admissions, preemptions)."""
    lora_loads: dict = field(default_factory=dict)
    """LoRA device slot -> the ``LoRARequest`` to write into it before this step runs."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


# ---------------------------------------------------------------- runner -> scheduler

@dataclass(frozen=True)
class LogprobsArrays:
    """Logprobs of ``n`` positions as host arrays (vLLM's ``LogprobsLists``): column 0 is the
    sampled (or prompt) token, the next ``k`` the top ones.  They become user-facing
    ``Logprob`` objects once, in the output processor."""

    token_ids: np.ndarray   # [n, 1 + k] int32
    logprobs: np.ndarray    # [n, 1 + k] float32
    ranks: np.ndarray       # [n] int32, 1-based rank of column 0's token in its distribution

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, rows: slice) -> "LogprobsArrays":
        return LogprobsArrays(self.token_ids[rows], self.logprobs[rows], self.ranks[rows])

    @staticmethod
    def concat(parts: "list[LogprobsArrays]", k: int) -> "LogprobsArrays":
        """``parts`` in order; none (a one-token prompt has no prompt logprobs): zero rows of ``k`` top ones."""
        if not parts:
            return LogprobsArrays(np.zeros((0, 1 + k), np.int32), np.zeros((0, 1 + k), np.float32),
                                  np.zeros(0, np.int32))
        return LogprobsArrays(np.concatenate([p.token_ids for p in parts]),
                              np.concatenate([p.logprobs for p in parts]),
                              np.concatenate([p.ranks for p in parts]))


@dataclass(frozen=True)
class RunnerOutput:
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    """Per request, in ``req_ids`` order; empty for a prefill chunk that is not the last."""
    logprobs: dict[str, LogprobsArrays] = field(default_factory=dict)
    """Only for requests that asked for logprobs: one row per sampled token."""
    prompt_logprobs: dict[str, LogprobsArrays] = field(default_factory=dict)
    """Only for requests that asked for prompt_logprobs, with their first sampled token: one
    entry per prompt token after the first (the token itself first, then the top ones)."""
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: tokens proposed for each request's next step (none: no proposal)."""
    pooled: dict = field(default_factory=dict)
    """Pooling requests whose last prompt chunk ran this step: request id -> the pooled row
    (numpy float32 [D])."""


EMPTY_RUNNER_OUTPUT = RunnerOutput(req_ids=[], sampled_token_ids=[])


# ---------------------------------------------------------------- engine core -> output processor

@dataclass(frozen=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsArrays | None = None
    finish_reason: str | None = None
    """'stop', 'length' or 'abort' once the request has ended."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it, None for EOS or length."""
    prompt_logprobs: LogprobsArrays | None = None
    """With the first output of a request that asked for prompt_logprobs."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache when the request was first scheduled."""
    pooled: object = None
    """A pooling request's pooled row (numpy float32 [D]), with its finishing output."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineCoreOutputs:
    """One engine-core step: each request's new tokens, and the step's scheduling events."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    events: list[SchedulingEvent] = field(default_factory=list)


# ---------------------------------------------------------------- what users see (vLLM's shape)

@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (vLLM's field); for n > 1, the most any
    of the samples got."""

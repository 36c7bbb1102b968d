"""What the controller (spec_decode/controller.py) asks of a proposer: one protocol that every
method implements (spec_decode/ngram.py, spec_decode/draft_model.py; a test's oracle), so the
controller never probes a proposer for the methods it happens to have.

A proposer is asked once per step for every request that proposes, all in one call (a model
proposes for them in one batch per draft step), and keeps whatever per-request state it needs
by request id until ``remove``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from jaxllm.sampling_params import SamplingParams


class ProposalRequest(Protocol):
    """What a proposer may read of a request (the runner's ``RequestState`` has it)."""

    token_ids: list[int]
    """Prompt and outputs so far: the proposals follow the last one."""
    num_prompt_tokens: int
    params: SamplingParams | None
    """The request's sampling parameters as the engine sent them (a draft model draws with them)."""
    seed: int
    block_ids: list[int]
    """The request's block table in the one KV manager as the last step used it: a draft
    model writes its own pages of these blocks (spec_decode/draft_model.py)."""


class Proposer(Protocol):
    free: bool
    """Asking costs nothing next to a step (no model: ngram).  The controller then asks for k
    tokens first and prices the step by the tokens actually found; otherwise it chooses k by
    ``cost`` and asks for that many."""

    def propose(self, requests: Mapping[str, ProposalRequest], k: int) -> dict[str, list[int]]:
        """Up to ``k`` tokens to follow each request's ``token_ids`` (id -> tokens; an id left
        out, or with an empty list, proposes nothing this step)."""
        ...

    def cost(self, k: int, num_requests: int) -> float | None:
        """Seconds proposing ``k`` tokens for ``num_requests`` requests takes (0.0 when free;
        None: not measured yet)."""
        ...

    def remove(self, req_id: str) -> None:
        """Drops the request's state (it ended or was preempted)."""
        ...

"""Draft-model proposals (``method: draft_model``): a smaller checkpoint with the same
vocabulary proposes k tokens by decoding them, run by the engine's own machinery: a
``ModelRunner`` (built by the target's runner from ``DraftModel``) with its own weights and
its buckets compiled ahead of time at start-up like the target's.

The draft's KV is one more cache kind of the one KV manager (engine/resolve._draft_kinds):
its pages are a second array indexed by the same block ids as the target's, so a request's
blocks hold both models' pages, the budget sizes both, and preemption or an ending frees both
at once.  There is no second block pool and no second scheduler: a draft step reads each
request's block table from the target runner's state of it (as the last target step used
it), and the scheduler allocates ``num_speculative_tokens`` lookahead slots beside each
request's tokens (core/scheduler.py) for the positions the draft's proposals take; a request
whose lookahead did not fit does not propose that step.

Per request id the proposer keeps the tokens whose KV the draft cache holds.  After each
target step it keeps the longest prefix of them that is still the request's sequence (what
the target accepted), computes the rest (chunked under the token budget: a request's first
proposal prefills its prompt), draws the first proposal, then decodes k - 1 more, all
proposing requests batched in every step.  The draft draws with the request's own sampling
parameters and seed, so at each output position its noise is the noise the target will use
there: a draft that agrees with the target's distribution proposes the target's token at any
temperature.  Structured outputs are not applied in the draft (the controller cuts its
proposals to the prefix the grammar accepts) and it computes no logprobs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from jaxllm.models.loader import LoadedModel
from jaxllm.runner.requests import RequestState
from jaxllm.runner.step_config import StepConfig
from jaxllm.sample.metadata import RowParams
from jaxllm.sampling_params import SamplingParams
from jaxllm.spec_decode.proposer import ProposalRequest

log = logging.getLogger("jaxllm.spec_decode")


@dataclasses.dataclass
class _Draft:
    params: SamplingParams
    seed: int
    num_prompt: int
    fed: list[int]
    """Tokens whose KV is in the draft cache, from position 0."""


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """The draft model of ``method: draft_model`` as the engine hands it to the target's runner,
    which builds the draft's runner from it once the KV size is known."""

    model: LoadedModel
    step: StepConfig
    """The draft's step configuration, resolved with the target's ``max_model_len``."""
    name: str
    """The checkpoint, for the log."""


@dataclasses.dataclass(frozen=True)
class DraftSetup:
    """What the draft model's proposer runs on (the target's runner builds it)."""

    runner: Any
    """The draft model's ``ModelRunner`` (its weights, its KV arrays, its compiled buckets): its
    KV arrays have as many blocks as the target's, addressed by the target's block ids."""
    block_size: int
    """The target's: a block id means the same positions in both caches."""
    max_num_batched_tokens: int
    """The target's token budget: a catch-up step is cut into chunks of it."""
    max_model_len: int


class DraftModelProposer:
    """The ``Proposer`` of ``method: draft_model`` (spec_decode/proposer.py)."""

    free = False
    """k steps of a model: the controller chooses k by ``cost`` before asking."""

    def __init__(self, setup: DraftSetup):
        self.runner = setup.runner
        if self.runner.cfg.block_size != setup.block_size:
            raise ValueError(f"--speculative-config: the draft model's KV blocks hold {self.runner.cfg.block_size} "
                             f"tokens and the target's {setup.block_size}: they share block ids, so they must be equal")
        self.block_size = setup.block_size
        self.budget = setup.max_num_batched_tokens
        self.max_model_len = setup.max_model_len
        self._drafts: dict[str, _Draft] = {}
        self.num_left_out = 0
        """Proposals not made because the request's blocks had no room for them (the scheduler's
        lookahead did not fit), for the log and the tests."""

    # ------------------------------------------------------------------ the proposer interface

    def remove(self, req_id: str) -> None:
        # Its blocks are the target's: the scheduler has freed them (or will, with the target's).
        if self._drafts.pop(req_id, None) is not None:
            self.runner.requests.drop(req_id)

    def propose(self, requests: Mapping[str, ProposalRequest], k: int) -> dict[str, list[int]]:
        """Up to ``k`` proposals for each of ``requests``, all of them batched in every draft step."""
        active: dict[str, list[int]] = {}
        for rid, r in requests.items():
            toks = r.token_ids
            d = self._drafts.get(rid)
            if d is None:
                sp = dataclasses.replace(r.params.clone(), structured_outputs=None, logprobs=None,
                                         prompt_logprobs=None)
                d = self._drafts[rid] = _Draft(sp, r.seed, r.num_prompt_tokens, [])
            # Keep the KV of the longest prefix the target kept.
            n = 0
            for a, b in zip(d.fed, toks):
                if a != b:
                    break
                n += 1
            del d.fed[n:]
            kk = min(k, self.max_model_len - len(toks))
            if kk <= 0:
                continue
            # The draft writes positions up to len(toks) + kk - 2 (its last proposal is not fed).
            if len(r.block_ids) * self.block_size < len(toks) + kk - 1:
                self.num_left_out += 1
                continue
            active[rid] = toks
        if not active:
            return {}
        blocks = {rid: requests[rid].block_ids for rid in active}
        out: dict[str, list[int]] = {rid: [] for rid in active}
        # Catch up (chunks of the token budget), drawing each request's first proposal.
        pending = {rid: len(toks) - len(self._drafts[rid].fed) for rid, toks in active.items()}
        while pending:
            sched: dict[str, int] = {}
            budget = self.budget
            for rid, n in pending.items():
                if budget <= 0:
                    break
                sched[rid] = min(n, budget)
                budget -= sched[rid]
            got = self._catch_up(sched, active, blocks)
            for rid, n in sched.items():
                self._drafts[rid].fed.extend(active[rid][len(self._drafts[rid].fed):len(self._drafts[rid].fed) + n])
                pending[rid] -= n
                if pending[rid] == 0:
                    del pending[rid]
                    out[rid].extend(got.get(rid, []))
        # Decode the rest: each step feeds every request's latest proposal.
        for j in range(1, k):
            live = [rid for rid, toks in active.items() if len(out[rid]) == j and len(toks) + j < self.max_model_len]
            if not live:
                break
            got = self._decode(live)
            for rid in live:
                self._drafts[rid].fed.append(out[rid][-1])
                out[rid].extend(got.get(rid, []))
        return {rid: d for rid, d in out.items() if d}

    def cost(self, k: int, n: int) -> float | None:
        """Seconds proposing ``k`` tokens for ``n`` requests takes: a catch-up step and k - 1
        decode rounds, each counted at the draft's measured time for n requests' decode (None
        until the draft has run such a step)."""
        if k == 0:
            return 0.0
        t = self.runner.measured_step_seconds(n, n)
        return None if t is None else k * t

    # ------------------------------------------------------------------ one draft step

    def _catch_up(self, sched: dict[str, int], seqs: dict[str, list[int]], blocks: dict[str, list[int]]
                  ) -> dict[str, list[int]]:
        """A catch-up step: each request of ``sched`` (id -> tokens to compute) is seated in the
        draft runner afresh (its tokens may have been cut back by the target since, and its
        sampler row restarts from them) on the target's block table, computing ``n`` tokens
        after those whose KV the draft holds.  Returns the tokens drawn."""
        states = self.runner.requests
        vocab = self.runner.arch.vocab_size
        for rid, n in sched.items():
            d = self._drafts[rid]
            c = len(d.fed)
            states.seat(rid, RequestState(token_ids=list(seqs[rid][:c + n]), num_prompt_tokens=d.num_prompt,
                                          block_ids=blocks[rid], num_computed_tokens=c,
                                          sampling=RowParams.from_sampling_params(d.params, d.seed, vocab),
                                          params=d.params, seed=d.seed))
        return self._drawn(self.runner.run_sequences(sched))

    def _decode(self, live: list[str]) -> dict[str, list[int]]:
        """A decode round: each request feeds the draft's own last draw (the runner appended
        it to the request's tokens), one token after those computed."""
        states = self.runner.requests
        for rid in live:
            st = states[rid]
            st.num_computed_tokens = len(st.token_ids) - 1
        return self._drawn(self.runner.run_sequences({rid: 1 for rid in live}))

    @staticmethod
    def _drawn(res) -> dict[str, list[int]]:
        return {rid: toks for rid, toks in zip(res.req_ids, res.sampled_token_ids) if toks}

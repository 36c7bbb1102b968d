"""Draft-model proposals (``method: draft_model``): a smaller checkpoint with the same
vocabulary proposes k tokens by decoding them, run by the engine's own machinery: a
``ModelRunner`` (built by the target's runner from ``DraftModel``) with its own weights, its
own paged KV cache and block pool (``KVCacheManager``), its buckets compiled ahead of time at
start-up like the target's.

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

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.models.loader import LoadedModel
from jaxllm.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from jaxllm.runner.step_config import StepConfig
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
    """The draft model's ``ModelRunner`` (its weights, its KV arrays, its compiled buckets)."""
    num_blocks: int
    """KV blocks of the draft's cache: as many as the target's."""
    block_size: int
    max_num_batched_tokens: int
    """The target's token budget: a catch-up step is cut into chunks of it."""
    max_model_len: int


class DraftModelProposer:
    """The ``Proposer`` of ``method: draft_model`` (spec_decode/proposer.py)."""

    free = False
    """k steps of a model: the controller chooses k by ``cost`` before asking."""

    def __init__(self, setup: DraftSetup):
        self.runner = setup.runner
        self.kv = KVCacheManager(setup.num_blocks, setup.block_size, enable_prefix_caching=False)
        self.budget = setup.max_num_batched_tokens
        self.max_model_len = setup.max_model_len
        self._drafts: dict[str, _Draft] = {}
        self._finished: set[str] = set()
        self.num_left_out = 0
        """Proposals not made because the draft's pool was full (for the log and the tests)."""

    # ------------------------------------------------------------------ the proposer interface

    def remove(self, req_id: str) -> None:
        if self._drafts.pop(req_id, None) is not None:
            self.kv.free(req_id)
            self._finished.add(req_id)

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
            if kk > 0:
                active[rid] = toks
        if not active:
            return {}
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
            got, full = self._step(sched, active)
            self.num_left_out += len(full)
            for rid in full:
                # No room in the draft's pool (it holds as many blocks as the target's, and
                # the target may have just seated more): this request does not propose this
                # time, and gives its blocks back to the others.
                del pending[rid], active[rid], sched[rid], out[rid]
                self.kv.free(rid)
                self._drafts[rid].fed.clear()
            for rid, n in sched.items():
                self._drafts[rid].fed.extend(active[rid][len(self._drafts[rid].fed):len(self._drafts[rid].fed) + n])
                pending[rid] -= n
                if pending[rid] == 0:
                    del pending[rid]
                    out[rid].extend(got.get(rid, []))
        # Decode the rest: each step feeds every request's latest proposal.
        for j in range(1, k):
            live = {rid: toks for rid, toks in active.items() if len(out[rid]) == j and
                    len(toks) + j < self.max_model_len}
            if not live:
                break
            seqs = {rid: toks + out[rid] for rid, toks in live.items()}
            got, full = self._step({rid: 1 for rid in live}, seqs, resend=False)
            self.num_left_out += len(full)
            for rid in live.keys() - full:
                self._drafts[rid].fed.append(seqs[rid][-1])
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

    def _step(self, sched: dict[str, int], seqs: dict[str, list[int]], resend: bool = True
              ) -> tuple[dict[str, list[int]], set[str]]:
        """Runs the draft's runner on ``sched`` (id -> tokens to compute this step).  A catch-up
        step (``resend``) sends every id in full (tokens, blocks, computed count): the tokens
        the runner holds may have been cut back by the target since.  A decode round sends
        only new blocks and the computed count: the runner appended its own draw, which is
        the token fed.  Returns the tokens drawn, and the ids left out for want of blocks."""
        new, cached, full = [], CachedRequestData(), set()
        for rid, n in list(sched.items()):
            d = self._drafts[rid]
            c = len(d.fed)
            blocks = self.kv.allocate_slots(rid, c + n)
            if blocks is None:
                full.add(rid)
                continue
            if resend:
                new.append(NewRequestData(req_id=rid, token_ids=list(seqs[rid][:c + n]), num_prompt_tokens=d.num_prompt,
                                          sampling_params=d.params, seed=d.seed,
                                          block_ids=list(self.kv.get_block_ids(rid)), num_computed_tokens=c))
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(list(blocks))
                cached.num_computed_tokens.append(c)
        run = {rid: n for rid, n in sched.items() if rid not in full}
        if not run:
            return {}, full
        so = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                             num_scheduled_tokens=run, total_num_scheduled_tokens=sum(run.values()),
                             finished_req_ids=self._finished)
        self._finished = set()
        res = self.runner.execute(so)
        return {rid: toks for rid, toks in zip(res.req_ids, res.sampled_token_ids) if toks}, full

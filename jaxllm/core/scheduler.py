"""Continuous-batching scheduler: who runs this step and how many tokens each computes.

There is no prefill or decode phase (vLLM v1's design): each request has
``num_computed_tokens`` and a target of ``num_tokens`` (prompt plus sampled tokens), and one
token budget per step is shared.  Running requests are served first, in admission order; a
long prompt is split into chunks; when the block pool runs dry a running request is
preempted (its blocks freed, recomputed later; blocks already in the prefix cache stay
reusable).  Waiting requests are admitted by policy:

- ``fcfs``: arrival order; a preempted request goes back to the front.  Victim: the newest.
- ``priority``: lowest ``priority`` value first (vLLM's convention), ties by arrival.
  Victim: the running request with the highest value (the latest to arrive among equals).
- ``lpm``: longest cached prefix first (the most tokens served from the prefix cache),
  ties by arrival.  Victim: the newest.

No request starves: once a request has been in the scheduler for ``starvation_steps``
steps it is admitted ahead of every request that has not (oldest first), and under
``priority`` it is never the victim while a request that is not starving runs (under
fcfs and lpm the victim is the most recently admitted request, which is never it while
later arrivals run).  A newly admitted request first
takes the longest cached prefix of its tokens (see ``kv_cache_manager``) and computes only
the rest.  Each admission and preemption is stamped as a ``SchedulingEvent`` in the step's
``SchedulerOutput`` (vLLM's ``record_event``), so that metrics such as queue time need not
poll the scheduler.  Pure Python: tested without a device by feeding hand-made ``RunnerOutput``s.

Speculative decoding: a decoding request with proposals (``RunnerOutput.draft_token_ids``
of its last step) computes its last token and the proposals in one step, as many as the
token budget, ``max_model_len`` and what is left of ``max_tokens`` allow.  The runner returns
the tokens plain decoding would have drawn up to and including the first rejected proposal;
the KV of the rejected ones is not counted as computed (it is overwritten later), and the
stop rules run token by token, so a stop inside an accepted run ends the request there.
With a draft model, each sampling request also gets ``num_lookahead_tokens`` slots past its
tokens, from the blocks the step left free, for the KV of the draft's proposals: one
allocation holds both models' pages (vLLM's lookahead slots).

Pooling requests (``Request.pooling``, an embedder's or classifier's prompt) are prefill-only:
admitted, chunked under the token budget and batched like any prompt, they never read or fill
the prefix cache, and ``update_from_output`` ends one at its last chunk with the runner's pooled
row (``RunnerOutput.pooled``), its blocks freed at once; the token the runner drew after it is
dropped.

Async scheduling (``async_scheduling=True``, engine/core.py): step N+1 is scheduled before
step N's tokens are known.  ``schedule()`` then advances ``num_computed_tokens`` at once and
counts each sampling request's token of the step as in flight (vLLM's output placeholders):
the next schedule computes it (the runner feeds it on the device), and a request whose
in-flight token will end it by length is not scheduled again.  ``update_from_output`` of
step N only appends the tokens and applies the stop rules; a request that ended at N has
its already scheduled step N+1 discarded (its outputs are skipped, its blocks were freed at
N's update).  A pooling request ends at the update of the step that ran its last chunk (where
that step's chunk started, plus its length: its computed count ran ahead when its later chunks
were scheduled), with that step's pooled row.  Speculative decoding is not combined with it (the engine schedules
synchronously for it, engine/core.py:_use_async).
"""

from __future__ import annotations

import time
from collections import deque

from jaxllm.config import SCHEDULING_POLICIES
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.lora_slots import LoRASlots
from jaxllm.outputs import (CachedRequestData, EngineCoreOutput, EventKind, NewRequestData, RunnerOutput,
                            SchedulerOutput, SchedulingEvent)
from jaxllm.request import Request, RequestStatus


POLICIES = SCHEDULING_POLICIES


def _chunk_starts(sched: SchedulerOutput) -> dict[str, int]:
    """Request id -> its computed tokens before ``sched``'s step (where the step's chunk starts)."""
    c = sched.scheduled_cached_reqs
    starts = dict(zip(c.req_ids, c.num_computed_tokens))
    starts.update((nr.req_id, nr.num_computed_tokens) for nr in sched.scheduled_new_reqs)
    return starts


class SpecDecodingStats:
    """Speculative decoding since start, in vLLM's terms: verifications with proposals
    (drafts), proposed and accepted tokens, and accepted tokens by position."""

    def __init__(self):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs", starvation_steps: int = 1000, clock=time.monotonic,
                 num_lookahead_tokens: int = 0, async_scheduling: bool = False, max_loras: int = 0):
        """``clock``: the events' timestamps (the clock of ``EngineRequest.arrival_time``);
        ``num_lookahead_tokens``: slots allocated past a sampling request's tokens where the
        pool has room (a draft model's proposals: spec_decode/draft_model.py);
        ``async_scheduling``: schedule a step before the previous one's tokens are known
        (the module's docstring); ``max_loras``: LoRA device slots (0: LoRA off), assigned
        to requests' adapters at admission (core/lora_slots.py)."""
        if policy not in POLICIES:
            raise ValueError(f"--scheduling-policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.kv = kv
        self.policy = policy
        self.starvation_steps = starvation_steps
        self._step = 0
        self._num_arrivals = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens
        if async_scheduling and num_lookahead_tokens:
            raise ValueError("async scheduling does not combine with speculative decoding's lookahead slots")
        self.async_scheduling = async_scheduling
        # Async scheduling: request id -> tokens sampled by a scheduled step, not yet returned (0 or 1).
        self._inflight: dict[str, int] = {}
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Ended since the last schedule(): the runner must drop their state.
        self._finished_req_ids: set[str] = set()
        # Requests the runner has state for (sent as new once, then as diffs).
        self._runner_knows: set[str] = set()
        self.num_preemptions = 0
        # Prompt tokens run through the model since start, counted as each prefill chunk completes
        # (a long chunked prefill shows in the prompt throughput while it runs, not at its end).
        self.num_prompt_tokens_computed = 0
        self.spec_stats = SpecDecodingStats()
        self.clock = clock
        self._events: list[SchedulingEvent] = []
        self.lora = LoRASlots(max_loras) if max_loras else None
        self._lora_loads: dict = {}   # slot -> adapter to write before the next step

    # ------------------------------------------------------------------ intake

    def add_request(self, request: Request) -> None:
        """Queues a request as the input processor made it: its id is not in use and its prompt
        is shorter than max_model_len (checked there, once, not again here)."""
        self.requests[request.request_id] = request
        request.arrival_seq = self._num_arrivals
        request.arrival_step = self._step
        self._num_arrivals += 1
        self.waiting.append(request)

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        """Ends requests at once and frees their blocks; unknown ids are ignored."""
        outs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            outs.append(EngineCoreOutput(rid, [], finish_reason="abort"))
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        self._step += 1
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        spec: dict[str, list[int]] = {}
        preempted_now = False

        # 1. Running requests in admission order; preempt by policy when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            inflight = self._inflight.get(req.request_id, 0)
            if inflight and self._ends_by_length(req, inflight):
                i += 1
                continue  # its in-flight token ends it: nothing more to compute
            n = min(req.num_tokens + inflight - req.num_computed_tokens, budget)
            if req.images:
                n = req.fit_images(req.num_computed_tokens, n)
            if n <= 0:
                i += 1
                continue
            drafts = self._drafts(req, n, budget)
            n += len(drafts)
            while True:
                blocks = self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n)
                if blocks is not None:
                    break
                victim = self._pick_victim()
                vi = self.running.index(victim)
                del self.running[vi]
                if victim.request_id in num_scheduled:      # scheduled earlier in this step: undo
                    budget += num_scheduled.pop(victim.request_id)
                    new_blocks.pop(victim.request_id, None)
                    spec.pop(victim.request_id, None)
                self._preempt(victim)
                preempted_now = True
                if victim is req:
                    break
                if vi < i:
                    i -= 1
            if blocks is None:
                continue  # req itself was preempted; running[i] is now the next one
            num_scheduled[req.request_id] = n
            new_blocks[req.request_id] = blocks
            if drafts:
                spec[req.request_id] = drafts
            budget -= n
            i += 1

        # 2. Waiting requests (new or preempted), unless this step had to preempt.
        if not preempted_now:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req, hit = self._next_waiting()
                lora = req.lora_request
                if lora is not None and not self.lora.can_acquire(lora):
                    break   # every slot is pinned by other adapters: it waits for one to free
                num_hit = len(hit) * self.kv.block_size
                n = min(req.num_tokens - num_hit, budget)
                if req.images:
                    n = req.fit_images(num_hit, n)
                    if n <= 0:
                        break   # its next image does not fit what is left of the budget: next step
                blocks = self.kv.allocate_slots(req.request_id, num_hit + n, hit)
                if blocks is None:
                    break
                self.waiting.remove(req)
                if lora is not None:
                    req.lora_slot, load = self.lora.acquire(lora)
                    if load:
                        self._lora_loads[req.lora_slot] = lora
                if req.num_cached_tokens is None:            # first admission
                    req.num_cached_tokens = num_hit
                    if self.kv.enable_prefix_caching and not req.skip_prefix_cache:
                        self.kv.count_query(req.num_tokens, num_hit)
                req.num_computed_tokens = num_hit
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                self._record(req, EventKind.SCHEDULED)
                num_scheduled[req.request_id] = n
                new_blocks[req.request_id] = blocks
                budget -= n

        # 3. Lookahead slots, from what this step's tokens left free (never a reason to preempt).
        if self.num_lookahead_tokens:
            for rid, n in num_scheduled.items():
                new_blocks[rid] = new_blocks[rid] + self._lookahead(self.requests[rid], n)

        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        for rid, n in num_scheduled.items():
            req = self.requests[rid]
            if rid not in self._runner_knows:
                self._runner_knows.add(rid)
                new_reqs.append(NewRequestData(
                    req_id=rid, token_ids=req.all_token_ids, num_prompt_tokens=req.num_prompt_tokens,
                    sampling_params=req.sampling_params, seed=req.seed,
                    block_ids=list(self.kv.get_block_ids(rid)),
                    num_computed_tokens=req.num_computed_tokens, lora_slot=req.lora_slot, images=req.images,
                    mrope=req.mrope))
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(new_blocks[rid])
                cached.num_computed_tokens.append(req.num_computed_tokens)

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_req_ids, scheduled_spec_decode_tokens=spec, events=self._events,
            lora_loads=self._lora_loads)
        self._lora_loads = {}
        self._finished_req_ids = set()
        self._events = []
        if self.async_scheduling:
            self._advance_scheduled(num_scheduled)
        return out

    def _ends_by_length(self, req: Request, inflight: int) -> bool:
        """Whether ``inflight`` more output tokens end ``req`` by max_tokens or max_model_len."""
        return (len(req.output_token_ids) + inflight >= req.max_tokens
                or req.num_tokens + inflight >= self.max_model_len)

    def _advance_scheduled(self, num_scheduled: dict[str, int]) -> None:
        """Async scheduling: the step just scheduled counts as computed now, and each request
        that samples in it has one token in flight until ``update_from_output``."""
        for rid, n in num_scheduled.items():
            req = self.requests[rid]
            target = req.num_tokens + self._inflight.get(rid, 0)
            self.num_prompt_tokens_computed += max(
                0, min(req.num_computed_tokens + n, req.num_prompt_tokens) - req.num_computed_tokens)
            req.num_computed_tokens += n
            if req.num_computed_tokens >= target and not req.pooling:   # a pooling request samples nothing
                self._inflight[rid] = self._inflight.get(rid, 0) + 1

    def _update_async(self, sched: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        """``update_from_output`` under async scheduling: the tokens were counted as computed
        when the step was scheduled; here they are appended and the stop rules applied.  A
        request preempted since keeps its tokens (its recompute feeds them)."""
        sampled = dict(zip(result.req_ids, result.sampled_token_ids))
        outs: list[EngineCoreOutput] = []
        starts = None
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            new_tokens = sampled.get(rid) or []
            if new_tokens and self._inflight.get(rid):
                self._inflight[rid] -= 1
                if not self._inflight[rid]:
                    del self._inflight[rid]
            if req is None or req.is_finished:
                continue  # ended (or aborted) while the step ran: its tokens are discarded
            if req.pooling:
                # Its computed count ran ahead when later chunks were scheduled: whether this
                # step ran its last chunk is read from the step itself (where it started + n).
                # Preempted since, it still ends here: the row of its last chunk is in ``result``.
                starts = _chunk_starts(sched) if starts is None else starts
                if starts[rid] + n >= req.num_tokens:
                    outs.append(self._finish_pooled(req, result))
                continue
            if req.status == RequestStatus.RUNNING:
                self.kv.cache_computed_blocks(req)
            if not new_tokens:
                continue  # a prefill chunk that is not the last samples nothing
            outs.append(self._append_sampled(req, new_tokens, result))
        return outs

    def _append_sampled(self, req: Request, new_tokens: list[int], result: RunnerOutput) -> EngineCoreOutput:
        """Appends a step's sampled tokens to ``req`` up to its first stop, ends it if one hit;
        the output of what was kept."""
        rid = req.request_id
        logprobs = result.logprobs.get(rid)
        start = len(req.output_token_ids)
        for tok in new_tokens:
            req.output_token_ids.append(tok)
            if self._check_stop(req):
                break
        accepted = req.output_token_ids[start:]
        out = EngineCoreOutput(
            rid, accepted, new_logprobs=logprobs[:len(accepted)] if logprobs else None,
            finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
            prompt_logprobs=result.prompt_logprobs.get(rid), num_cached_tokens=req.num_cached_tokens or 0)
        if req.is_finished:
            self._finish(req, req.status)
        return out

    def _finish_pooled(self, req: Request, result: RunnerOutput) -> EngineCoreOutput:
        """Ends a pooling request whose last chunk ran: its pooled row out, its blocks freed now."""
        rid = req.request_id
        if rid not in result.pooled:
            raise RuntimeError(f"pooling request {rid}: its last chunk ran but the runner returned no pooled row")
        self._finish(req, RequestStatus.FINISHED_STOPPED)
        return EngineCoreOutput(rid, [], finish_reason="stop", pooled=result.pooled[rid], num_cached_tokens=0)

    def update_from_output(self, sched: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        """Advances computed tokens, appends sampled tokens, applies stop rules."""
        if self.async_scheduling:
            return self._update_async(sched, result)
        sampled = dict(zip(result.req_ids, result.sampled_token_ids))
        outs: list[EngineCoreOutput] = []
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue  # aborted while the step ran
            new_tokens = sampled.get(rid) or []
            drafts = sched.scheduled_spec_decode_tokens.get(rid)
            if drafts:
                # 1 + accepted tokens came back: the KV of the rejected proposals is not valid.
                accepted = len(new_tokens) - 1
                n -= len(drafts) - accepted
                self.spec_stats.observe(len(drafts), accepted)
            self.num_prompt_tokens_computed += max(
                0, min(req.num_computed_tokens + n, req.num_prompt_tokens) - req.num_computed_tokens)
            req.num_computed_tokens += n
            if req.pooling:
                if req.num_computed_tokens >= req.num_tokens:
                    outs.append(self._finish_pooled(req, result))
                continue
            self.kv.cache_computed_blocks(req)
            req.spec_token_ids = result.draft_token_ids.get(rid) or []
            if req.num_computed_tokens < req.num_tokens or not new_tokens:
                continue  # a prefill chunk that is not the last samples nothing
            outs.append(self._append_sampled(req, new_tokens, result))
        return outs

    # ------------------------------------------------------------------ policies

    def _starving(self, req: Request) -> bool:
        return self._step - req.arrival_step >= self.starvation_steps

    def _rank(self, req: Request, num_hit_blocks: int = 0) -> tuple:
        """Admission order (smallest first); the preemption victim is the largest."""
        if self._starving(req):
            return (0, req.arrival_seq)
        if self.policy == "priority":
            return (1, req.priority, req.arrival_seq)
        if self.policy == "lpm":
            return (1, -num_hit_blocks, req.arrival_seq)
        return (1, req.arrival_seq)

    def _next_waiting(self) -> tuple[Request, list[int]]:
        """The waiting request to admit next and its prefix-cache hit (blocks)."""
        if self.policy == "fcfs":
            # The deque is in order already (preempted requests were put back in front), and
            # a starving request has been waiting longest, so it is at the front too.
            req = self.waiting[0]
            return req, self.kv.find_cached_prefix(req)
        if self.policy == "priority":
            req = min(self.waiting, key=self._rank)
            return req, self.kv.find_cached_prefix(req)
        best = None
        for req in self.waiting:
            hit = self.kv.find_cached_prefix(req)
            key = self._rank(req, len(hit))
            if best is None or key < best[0]:
                best = (key, req, hit)
        return best[1], best[2]

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=self._rank)
        # fcfs / lpm: the most recently admitted.  A starving request is admitted before any
        # other waiting one, so whatever is admitted after it is preempted first; only the
        # finitely many requests admitted before it can push it out, and they finish.
        return self.running[-1]

    # ------------------------------------------------------------------ helpers

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """The proposals ``req`` verifies this step: none unless it decodes (one token to
        compute), then as many as fit the token budget, ``max_model_len`` (the last one's
        position) and ``max_tokens`` (a verification emits up to 1 + len(proposals) tokens)."""
        if not req.spec_token_ids or n != 1:
            return []
        k = min(len(req.spec_token_ids), budget - 1, self.max_model_len - req.num_tokens,
                req.max_tokens - len(req.output_token_ids) - 1)
        return req.spec_token_ids[:max(k, 0)]

    def _lookahead(self, req: Request, n: int) -> list[int]:
        """Blocks for ``num_lookahead_tokens`` positions past the ``n`` tokens ``req`` computes
        this step, if it samples in it and the pool has them all (else none): a draft model
        writes its proposals' KV there after the step, in its own pages of the request's
        blocks; the next verification computes the target's KV at the same positions."""
        if req.num_computed_tokens + n < req.num_tokens:
            return []       # a prefill chunk that is not the last: nothing is proposed after it
        want = min(req.num_computed_tokens + n + self.num_lookahead_tokens, self.max_model_len)
        return self.kv.allocate_slots(req.request_id, want) or []

    def _check_stop(self, req: Request) -> bool:
        sp = req.sampling_params
        n_out = len(req.output_token_ids)
        if req.num_tokens >= self.max_model_len or n_out >= req.max_tokens:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        if n_out < sp.min_tokens:
            return False
        last = req.output_token_ids[-1]
        if not sp.ignore_eos and last in req.eos_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in sp.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = last
            return True
        return False

    def _record(self, req: Request, kind: str) -> None:
        self._events.append(SchedulingEvent(req.request_id, kind, self.clock()))

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.lora.release(req.lora_slot)
            req.lora_slot = -1

    def _preempt(self, req: Request) -> None:
        self._record(req, EventKind.PREEMPTED)
        self._release_lora(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        # Its in-flight token still arrives (update_from_output appends it); the recompute
        # after readmission feeds it from the host.
        self._inflight.pop(req.request_id, None)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._forget_in_runner(req.request_id)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self._release_lora(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        self._forget_in_runner(req.request_id)
        self._inflight.pop(req.request_id, None)
        del self.requests[req.request_id]

    def _forget_in_runner(self, rid: str) -> None:
        if rid in self._runner_knows:
            self._runner_knows.discard(rid)
            self._finished_req_ids.add(rid)

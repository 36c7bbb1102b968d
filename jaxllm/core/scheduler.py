"""Continuous-batching scheduler: who runs this step and how many tokens each computes.

There is no prefill or decode phase (vLLM v1's design): each request has
``num_computed_tokens`` and a target of ``num_tokens`` (prompt plus sampled tokens), and one
token budget per step is shared.  Running requests are served first, in arrival order; a
long prompt is split into chunks; when the block pool runs dry the newest running request
is preempted (its blocks freed, recomputed later).  Pure Python: tested without a device
by feeding hand-made ``RunnerOutput``s.
"""

from __future__ import annotations

from collections import deque

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.outputs import (CachedRequestData, EngineCoreOutput, NewRequestData, RunnerOutput,
                            SchedulerOutput)
from jaxllm.request import Request, RequestStatus


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Ended since the last schedule(): the runner must drop their state.
        self._finished_req_ids: set[str] = set()
        # Requests the runner has state for (sent as new once, then as diffs).
        self._runner_knows: set[str] = set()
        self.num_preemptions = 0

    # ------------------------------------------------------------------ intake

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens > self.max_model_len:
            raise ValueError(f"request {request.request_id!r} has {request.num_tokens} tokens, "
                             f"more than max_model_len={self.max_model_len}")
        self.requests[request.request_id] = request
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

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        preempted_now = False

        # 1. Running requests, oldest first; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while True:
                blocks = self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n)
                if blocks is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted_now = True
                if victim is req:
                    break
            if blocks is None:
                break  # req itself was preempted; everything after it already was too
            num_scheduled[req.request_id] = n
            new_blocks[req.request_id] = blocks
            budget -= n
            i += 1

        # 2. Waiting requests (new or preempted), unless this step had to preempt.
        if not preempted_now:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                blocks = self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n)
                if blocks is None:
                    break
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                num_scheduled[req.request_id] = n
                new_blocks[req.request_id] = blocks
                budget -= n

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
                    num_computed_tokens=req.num_computed_tokens))
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(new_blocks[rid])
                cached.num_computed_tokens.append(req.num_computed_tokens)

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        return out

    def update_from_output(self, sched: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        """Advances computed tokens, appends sampled tokens, applies stop rules."""
        sampled = dict(zip(result.req_ids, result.sampled_token_ids))
        outs: list[EngineCoreOutput] = []
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue  # aborted while the step ran
            req.num_computed_tokens += n
            new_tokens = sampled.get(rid) or []
            if req.num_computed_tokens < req.num_tokens or not new_tokens:
                continue  # a prefill chunk that is not the last samples nothing
            logprobs = result.logprobs.get(rid)
            accepted = []
            for tok in new_tokens:
                req.output_token_ids.append(tok)
                accepted.append(tok)
                if self._check_stop(req):
                    break
            outs.append(EngineCoreOutput(
                rid, accepted, new_logprobs=logprobs[:len(accepted)] if logprobs else None,
                finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
                prompt_logprobs=result.prompt_logprobs.get(rid)))
            if req.is_finished:
                self._finish(req, req.status)
        return outs

    # ------------------------------------------------------------------ helpers

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

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._forget_in_runner(req.request_id)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        self._forget_in_runner(req.request_id)
        del self.requests[req.request_id]

    def _forget_in_runner(self, rid: str) -> None:
        if rid in self._runner_knows:
            self._runner_knows.discard(rid)
            self._finished_req_ids.add(rid)

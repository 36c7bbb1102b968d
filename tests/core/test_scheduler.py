"""Scheduler and KV-cache manager, without a device: hand-made RunnerOutputs drive them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.scheduler import Scheduler
from jaxllm.outputs import EventKind, RunnerOutput, SchedulingEvent
from jaxllm.request import ImageInput, Request, RequestStatus
from jaxllm.sampling_params import SamplingParams
from support.scheduler_steps import run_step

EOS = 2


def make(rid, n_prompt, max_tokens=8, **sp):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **sp)
    return Request(rid, list(range(10, 10 + n_prompt)), params, eos_token_ids=(EOS,), max_tokens=max_tokens)


def sched(num_blocks=64, block=4, seqs=4, budget=16, max_len=64):
    return Scheduler(KVCacheManager(num_blocks, block), max_num_seqs=seqs, max_num_batched_tokens=budget,
                     max_model_len=max_len)


def test_core_does_not_import_jax():
    code = ("import sys, jaxllm.core.scheduler, jaxllm.core.kv_cache_manager, jaxllm.core.kv_budget; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_pool_allocates_and_frees():
    kv = KVCacheManager(num_blocks=5, block_size=4)   # block 0 is the reserved null block
    assert kv.num_blocks == 4
    assert kv.allocate_slots("a", 5) == [1, 2]
    assert kv.allocate_slots("a", 8) == []          # still fits in two blocks
    assert kv.allocate_slots("b", 12) is None        # needs 3, only 2 free: nothing allocated
    assert kv.num_free_blocks == 2 and kv.get_block_ids("b") == []
    kv.free("a")
    assert kv.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        kv.pool.release([0])


def test_chunked_prefill_respects_the_token_budget():
    s = sched(budget=8)
    s.add_request(make("a", 20))
    chunks = []
    for _ in range(3):
        so, outs = run_step(s)
        chunks.append(so.num_scheduled_tokens["a"])
    assert chunks == [8, 8, 4]
    assert s.requests["a"].output_token_ids == [7]   # a token only after the last chunk


def test_prompt_tokens_are_counted_as_each_chunk_completes():
    # The server's prompt throughput reads this counter: a long chunked prefill must show while
    # it runs, not only when its first token comes out.
    s = sched(budget=8)
    s.add_request(make("a", 20))
    counted = []
    for _ in range(4):
        run_step(s)
        counted.append(s.num_prompt_tokens_computed)
    assert counted == [8, 16, 20, 20]   # decode steps add no prompt tokens


def test_decodes_are_served_before_new_prefills_and_share_the_budget():
    s = sched(budget=10, seqs=4)
    s.add_request(make("a", 3))
    run_step(s)                                      # a prefilled, has 1 output
    s.add_request(make("b", 30))
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]
    assert so.scheduled_cached_reqs.req_ids == ["a"]


def test_max_num_seqs_caps_the_running_set():
    s = sched(seqs=2, budget=64)
    for i in range(4):
        s.add_request(make(f"r{i}", 3))
    so, _ = run_step(s)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert len(s.waiting) == 2


def test_stop_rules():
    s = sched()
    s.add_request(make("eos", 3))
    s.add_request(make("stoptok", 3, stop_token_ids=[9]))
    s.add_request(make("len", 3, max_tokens=2))
    s.add_request(make("mintok", 3, min_tokens=2))
    _, outs = run_step(s, tokens={"eos": EOS, "stoptok": 9, "len": 5, "mintok": EOS})
    by = {o.request_id: o for o in outs}
    assert by["eos"].finish_reason == "stop" and by["eos"].stop_reason is None
    assert by["stoptok"].finish_reason == "stop" and by["stoptok"].stop_reason == 9
    assert by["len"].finish_reason is None
    assert by["mintok"].finish_reason is None        # EOS before min_tokens does not stop
    _, outs = run_step(s, tokens={"len": 5, "mintok": EOS})
    by = {o.request_id: o for o in outs}
    assert by["len"].finish_reason == "length"
    assert by["mintok"].finish_reason == "stop"
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_ignore_eos_and_max_model_len():
    s = sched(max_len=6)
    s.add_request(make("a", 4, max_tokens=100, ignore_eos=True))
    _, o1 = run_step(s, token=EOS)
    _, o2 = run_step(s, token=EOS)
    assert o1[0].finish_reason is None
    assert o2[0].finish_reason == "length"          # 4 prompt + 2 output = max_model_len


def test_preemption_frees_blocks_and_recomputes_later():
    # 6 usable blocks of 4 tokens: two requests of 8 prompt tokens fill 4 blocks, growth preempts.
    s = sched(num_blocks=7, block=4, budget=32, max_len=24)
    s.add_request(make("old", 8, max_tokens=10))
    s.add_request(make("new", 8, max_tokens=10))
    run_step(s)
    preempted_at = None
    for step in range(30):
        so, _ = run_step(s)
        if s.num_preemptions and preempted_at is None:
            preempted_at = step
            assert s.requests["new"].status == RequestStatus.PREEMPTED   # the newest goes first
            assert s.requests["new"].num_computed_tokens == 0
            assert "new" not in so.num_scheduled_tokens
        if not s.has_unfinished_requests():
            break
    assert preempted_at is not None, "precondition: the small pool never forced a preemption"
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == 6


def test_admissions_and_preemptions_are_reported_as_events():
    """The scheduler stamps each admission and preemption in its output (what queue-time
    metrics read), with its clock, once: a running request's later steps report nothing."""
    ticks = iter(range(100, 1000))
    s = Scheduler(KVCacheManager(7, 4), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=24,
                  clock=lambda: float(next(ticks)))
    s.add_request(make("old", 8, max_tokens=10))
    s.add_request(make("new", 8, max_tokens=10))
    so, _ = run_step(s)
    assert so.events == [SchedulingEvent("old", EventKind.SCHEDULED, 100.0),
                         SchedulingEvent("new", EventKind.SCHEDULED, 101.0)]
    events = []
    while s.has_unfinished_requests():
        so, _ = run_step(s)
        events += [(e.request_id, e.kind) for e in so.events]
    assert events[0] == ("new", EventKind.PREEMPTED)
    assert ("new", EventKind.SCHEDULED) in events[1:]      # admitted again after the preemption
    assert events.count(("new", EventKind.SCHEDULED)) == 1 and ("old", EventKind.SCHEDULED) not in events


def test_preempted_request_is_resent_in_full_with_its_outputs():
    s = sched(num_blocks=7, block=4, budget=32, max_len=24)
    s.add_request(make("old", 8, max_tokens=10))
    s.add_request(make("new", 8, max_tokens=10))
    run_step(s)
    while not s.num_preemptions:
        run_step(s)
    req = s.requests["new"]
    assert req.output_token_ids, "preempted after it had sampled"
    while True:
        expected = req.prompt_token_ids + req.output_token_ids
        so, _ = run_step(s)
        resent = [r for r in so.scheduled_new_reqs if r.req_id == "new"]
        if resent:
            assert resent[0].token_ids == expected
            assert resent[0].num_prompt_tokens == 8
            assert resent[0].num_computed_tokens == 0
            break


def test_abort_frees_blocks_and_tells_the_runner():
    s = sched()
    s.add_request(make("a", 10))
    s.add_request(make("b", 3))
    run_step(s)
    free_before = s.kv.num_free_blocks
    outs = s.abort_requests(["a", "unknown"])
    assert [o.finish_reason for o in outs] == ["abort"]
    assert s.kv.num_free_blocks > free_before
    so = s.schedule()
    assert "a" in so.finished_req_ids and "a" not in so.num_scheduled_tokens


def test_pooling_requests_are_chunked_batched_and_end_at_their_last_chunk():
    """Prefill-only: chunked under the budget, batched together, ended at the last chunk with the
    runner's pooled row (no sampled token), blocks freed at once, the prefix cache neither read
    nor filled."""
    s = Scheduler(KVCacheManager(64, 4, enable_prefix_caching=True), max_num_seqs=4, max_num_batched_tokens=16,
                  max_model_len=64)
    free = s.kv.num_free_blocks
    prompt = list(range(10, 30))                       # 20 tokens: longer than a step
    s.add_request(Request("p", prompt, SamplingParams(max_tokens=1), pooling=True))
    s.add_request(Request("q", list(range(40, 45)), SamplingParams(max_tokens=1), pooling=True))

    def step():
        so = s.schedule()
        done = [r for r, n in so.num_scheduled_tokens.items()
                if s.requests[r].num_computed_tokens + n == s.requests[r].num_tokens]
        pooled = {r: f"row-{r}" for r in done}
        ids = list(so.num_scheduled_tokens)
        outs = s.update_from_output(so, RunnerOutput(ids, [[7]] * len(ids), pooled=pooled))
        return so, outs

    so, outs = step()
    assert so.num_scheduled_tokens == {"p": 16} and outs == []
    so, outs = step()
    assert so.num_scheduled_tokens == {"p": 4, "q": 5}  # the last chunk of one beside another's whole prompt
    assert [(o.request_id, o.pooled, o.finish_reason, o.new_token_ids) for o in outs] == [
        ("p", "row-p", "stop", []), ("q", "row-q", "stop", [])]
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == free
    assert so.finished_req_ids == set() and s.schedule().finished_req_ids == {"p", "q"}   # the runner drops them
    # A generation request's prompt fills the cache; a pooling request of the same prompt does not read it.
    s.add_request(Request("g", prompt, SamplingParams(max_tokens=1), max_tokens=1))
    while s.has_unfinished_requests():
        run_step(s)
    s.add_request(Request("p2", prompt, SamplingParams(max_tokens=1), pooling=True))
    so, _ = step()
    assert so.num_scheduled_tokens == {"p2": 16} and s.requests["p2"].num_cached_tokens == 0
    # A last chunk without its pooled row is a runner bug, not a silent empty result.
    so = s.schedule()
    with pytest.raises(RuntimeError, match="no pooled row"):
        s.update_from_output(so, RunnerOutput(["p2"], [[7]]))



def test_a_prefill_chunk_ends_inside_a_causal_image_only():
    # Gemma 3's image tokens see each other both ways: a chunk stops before the image; Qwen's
    # attend causally (ImageInput.causal): a chunk may end inside one
    for causal, want in ((False, 5), (True, 8)):
        req = Request("r", list(range(10, 30)), SamplingParams(max_tokens=1),
                      images=(ImageInput(None, "h", 5, 6, causal=causal),))
        assert req.fit_images(0, 8) == want and req.fit_images(0, 11) == 11

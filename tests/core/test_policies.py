"""Scheduling policies (fcfs, priority, lpm) and the starvation guard, without a device."""

from __future__ import annotations

import pytest
from support.scheduler_steps import run_step

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.scheduler import Scheduler
from jaxllm.request import Request, RequestStatus
from jaxllm.sampling_params import SamplingParams

BS = 4


def req(rid, tokens, max_tokens=1, priority=0):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(tokens), params, eos_token_ids=(2,), max_tokens=max_tokens, priority=priority)


def sched(policy, num_blocks=64, budget=64, seqs=1, max_len=64, caching=True, **kw):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(kv, max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len, policy=policy,
                     **kw)


def admission_order(s) -> list[str]:
    """Runs to completion; the order in which requests were first scheduled."""
    order = []
    for _ in range(500):
        if not s.has_unfinished_requests():
            return order
        so, _ = run_step(s)
        order += [nr.req_id for nr in so.scheduled_new_reqs if nr.req_id not in order]
    raise AssertionError("did not finish")


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="--scheduling-policy"):
        sched("sjf")


def test_fcfs_admits_in_arrival_order():
    s = sched("fcfs")
    for rid, prio in (("a", 5), ("b", 0), ("c", 9), ("d", 0)):
        s.add_request(req(rid, range(10, 15), priority=prio))
    assert admission_order(s) == ["a", "b", "c", "d"]


def test_priority_admits_lowest_value_first_ties_by_arrival():
    s = sched("priority")
    for rid, prio in (("a", 5), ("b", 0), ("c", 9), ("d", 0), ("e", -1)):
        s.add_request(req(rid, range(10, 15), priority=prio))
    assert admission_order(s) == ["e", "b", "d", "a", "c"]


def test_priority_preempts_the_highest_value_not_the_newest():
    # 6 usable blocks of 4; three requests of 4 prompt tokens grow to 12 tokens each: they
    # cannot all fit, and the one to go is the lowest priority ("low", admitted first).
    s = sched("priority", num_blocks=7, budget=64, seqs=3, max_len=16)
    s.add_request(req("low", range(10, 14), max_tokens=8, priority=7))
    run_step(s)                                  # "low" runs alone first
    s.add_request(req("high", range(20, 24), max_tokens=8, priority=0))
    s.add_request(req("mid", range(30, 34), max_tokens=8, priority=3))
    while not s.num_preemptions:
        run_step(s)
    assert s.requests["low"].status == RequestStatus.PREEMPTED
    assert {r.request_id for r in s.running} == {"high", "mid"}
    admission_order(s)                           # everything still completes
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_fcfs_preempts_the_newest():
    s = sched("fcfs", num_blocks=7, budget=64, seqs=3, max_len=16)
    s.add_request(req("low", range(10, 14), max_tokens=8, priority=7))
    run_step(s)
    s.add_request(req("high", range(20, 24), max_tokens=8, priority=0))
    s.add_request(req("mid", range(30, 34), max_tokens=8, priority=3))
    while not s.num_preemptions:
        run_step(s)
    assert s.requests["mid"].status == RequestStatus.PREEMPTED


def test_lpm_admits_the_longest_cached_prefix_first():
    s = sched("lpm", seqs=1)
    shared = list(range(100, 112))               # three blocks
    s.add_request(req("seed", shared + [1]))
    admission_order(s)                           # caches "shared"
    s.add_request(req("none", range(200, 213)))
    s.add_request(req("short", shared[:4] + list(range(300, 309))))    # one cached block
    s.add_request(req("long", shared + [5]))                           # three
    s.add_request(req("mid", shared[:8] + list(range(400, 405))))      # two
    assert admission_order(s) == ["long", "mid", "short", "none"]


def test_lpm_without_cache_hits_is_fcfs():
    s = sched("lpm", caching=False)
    for rid in "abcd":
        s.add_request(req(rid, range(10, 15)))
    assert admission_order(s) == list("abcd")


def _stream_of_high_priority(s, steps):
    """Every step a new high-priority request arrives (one runs at a time): returns the step at
    which "low" finished, or None."""
    s.add_request(req("low", range(50, 55), max_tokens=3, priority=10))
    for i in range(steps):
        s.add_request(req(f"hi{i}", range(60, 65), max_tokens=2, priority=0))
        run_step(s)
        if "low" not in s.requests:
            return i
    return None


def test_low_priority_request_completes_under_endless_high_priority_arrivals():
    s = sched("priority", seqs=1, starvation_steps=50)
    done = _stream_of_high_priority(s, 200)
    assert done is not None and 50 <= done < 60
    # The control: without the guard it waits for as long as high-priority requests arrive.
    s = sched("priority", seqs=1, starvation_steps=10**9)
    assert _stream_of_high_priority(s, 200) is None


def test_lpm_request_without_a_cached_prefix_is_not_starved():
    s = sched("lpm", seqs=1, starvation_steps=30)
    shared = list(range(100, 112))
    s.add_request(req("seed", shared + [1]))
    run_step(s)
    s.add_request(req("cold", range(500, 513), max_tokens=2))
    for i in range(100):
        s.add_request(req(f"warm{i}", shared + [i % 7], max_tokens=2))
        run_step(s)
        if "cold" not in s.requests:
            break
    assert "cold" not in s.requests and i < 40


def test_a_starving_request_is_not_the_preemption_victim():
    s = sched("priority", num_blocks=7, budget=64, seqs=3, max_len=16, starvation_steps=1)
    s.add_request(req("low", range(10, 14), max_tokens=8, priority=7))
    run_step(s)
    run_step(s)                                  # "low" is now starving
    s.add_request(req("high", range(20, 24), max_tokens=8, priority=0))
    s.add_request(req("mid", range(30, 34), max_tokens=8, priority=3))
    while not s.num_preemptions:
        run_step(s)
    assert s.requests["low"].status == RequestStatus.RUNNING

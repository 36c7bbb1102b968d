"""core/lora_slots.py through the scheduler, without a device: adapters get slots at
admission, a slot a running request uses is never taken, a request whose adapter finds no
free slot waits (and runs once one frees), the least recently used adapter is evicted, and
each slot write is asked for once; the prefix cache does not mix adapters."""

from __future__ import annotations

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.scheduler import Scheduler
from jaxllm.lora.request import LoRARequest
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams

from support.scheduler_steps import run_step

A, B, C = (LoRARequest(n, i + 1, f"/adapters/{n}") for i, n in enumerate("abc"))


def make(rid, lora, n_prompt=4, max_tokens=3):
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(temperature=0, max_tokens=max_tokens),
                   max_tokens=max_tokens, lora_request=lora)


def sched(max_loras=2):
    return Scheduler(KVCacheManager(64, 4, enable_prefix_caching=True), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                     max_loras=max_loras)


def test_a_request_waits_for_a_slot_and_the_lru_adapter_is_evicted():
    s = sched()
    for rid, lora in (("a", A), ("base", None), ("b", B), ("c", C)):
        s.add_request(make(rid, lora, max_tokens=3 if rid != "b" else 5))
    so, _ = run_step(s)
    # fcfs: a, base and b admitted; c's adapter finds both slots pinned and waits.
    assert set(so.num_scheduled_tokens) == {"a", "base", "b"}
    slots = {nr.req_id: nr.lora_slot for nr in so.scheduled_new_reqs}
    assert slots["base"] == -1 and {slots["a"], slots["b"]} == {0, 1}
    assert so.lora_loads == {slots["a"]: A, slots["b"]: B}
    while "c" not in {nr.req_id for nr in so.scheduled_new_reqs}:
        assert not s.requests["c"].is_finished
        so, _ = run_step(s)
    # a finished first: its slot (least recently used, unpinned) went to c; b still holds its own.
    c_slot = next(nr.lora_slot for nr in so.scheduled_new_reqs if nr.req_id == "c")
    assert c_slot == slots["a"] and so.lora_loads == {c_slot: C}
    assert "b" in s.requests and s.lora.resident()[slots["b"]] == B


def test_a_resident_adapter_is_not_written_again():
    s = sched()
    s.add_request(make("a1", A))
    so, _ = run_step(s)
    assert list(so.lora_loads.values()) == [A]
    s.add_request(make("a2", A))
    so, _ = run_step(s)
    assert "a2" in so.num_scheduled_tokens and so.lora_loads == {}


def test_prefix_cache_blocks_are_keyed_by_adapter():
    s = sched()
    s.add_request(make("base", None, n_prompt=12))
    while s.has_unfinished_requests():
        run_step(s)
    for rid, lora, hit in (("with_a", A, 0), ("base_again", None, 8)):
        req = make(rid, lora, n_prompt=12)
        assert len(s.kv.find_cached_prefix(req)) * 4 == hit, rid

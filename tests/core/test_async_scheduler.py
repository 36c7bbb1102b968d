"""The scheduler under async scheduling, without a device: step N+1 is scheduled before step
N's tokens are applied; a request's in-flight token is computed by the next step, a request
its in-flight token ends by length is not scheduled again, and one that ends at N has its
step N+1 discarded with its blocks back in the pool."""

from __future__ import annotations

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.scheduler import Scheduler
from jaxllm.outputs import RunnerOutput
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams

EOS = 2


def make(rid, n_prompt, max_tokens=8):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Request(rid, list(range(10, 10 + n_prompt)), params, eos_token_ids=(EOS,), max_tokens=max_tokens)


def async_sched(num_blocks=64, prefix_caching=False):
    return Scheduler(KVCacheManager(num_blocks, 4, enable_prefix_caching=prefix_caching), max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                     async_scheduling=True)


def sampled(so, token):
    """Every scheduled request samples ``token`` (each one here finishes its prompt at once)."""
    ids = list(so.num_scheduled_tokens)
    return RunnerOutput(ids, [[token] for _ in ids])


def test_next_step_is_scheduled_before_the_tokens_arrive():
    s = async_sched()
    s.add_request(make("a", 5, max_tokens=3))
    so1 = s.schedule()
    assert so1.num_scheduled_tokens == {"a": 5}
    # Step 2 computes the token step 1 is still sampling.
    so2 = s.schedule()
    assert so2.num_scheduled_tokens == {"a": 1}
    assert so2.scheduled_cached_reqs.num_computed_tokens == [5]
    outs = s.update_from_output(so1, sampled(so1, 7))
    assert [o.new_token_ids for o in outs] == [[7]]
    so3 = s.schedule()
    assert so3.num_scheduled_tokens == {"a": 1}
    outs = s.update_from_output(so2, sampled(so2, 8))
    assert [o.new_token_ids for o in outs] == [[8]]
    # Its in-flight (third) token reaches max_tokens: nothing more is scheduled for it.
    assert s.schedule().num_scheduled_tokens == {}
    outs = s.update_from_output(so3, sampled(so3, 9))
    assert outs[0].new_token_ids == [9] and outs[0].finish_reason == "length"
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_a_request_ended_at_n_has_step_n_plus_1_discarded():
    s = async_sched()
    s.add_request(make("a", 5))
    so1 = s.schedule()
    so2 = s.schedule()                      # scheduled before step 1's EOS is known
    outs = s.update_from_output(so1, sampled(so1, EOS))
    assert outs[0].finish_reason == "stop"
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert s.update_from_output(so2, sampled(so2, 7)) == []     # discarded
    so3 = s.schedule()
    assert so3.is_empty and so3.finished_req_ids == {"a"}
    assert not s.has_unfinished_requests()


def test_a_block_completed_by_an_in_flight_token_is_cached_once_its_token_is_known():
    """The prefix cache registers a full block under the hash of its tokens.  Under async
    scheduling ``num_computed_tokens`` counts the in-flight token before the host has it: the
    block it completes must wait for it (hashed early, it was registered under the hash of
    its first three tokens, and every later block of the request under hashes chained from
    it: a follow-up prompt found none of them)."""
    s = async_sched(prefix_caching=True)
    a = make("a", 3, max_tokens=6)          # 4-token blocks: its first sampled token completes block 0
    s.add_request(a)
    tokens, pending = iter(range(40, 60)), None
    while s.has_unfinished_requests() or pending is not None:
        so = s.schedule()                   # as EngineCore._step_async: N+1 scheduled, then N applied
        if pending is not None:
            s.update_from_output(pending, sampled(pending, next(tokens)))
        pending = None if so.is_empty else so
    assert a.output_token_ids == [40, 41, 42, 43, 44, 45]
    # Computed: the prompt and all outputs but the last (8 tokens, two full blocks).
    follow_up = Request("b", a.all_token_ids[:8] + [99], SamplingParams(temperature=0, max_tokens=1),
                        eos_token_ids=(EOS,), max_tokens=1)
    assert len(s.kv.find_cached_prefix(follow_up)) == 2

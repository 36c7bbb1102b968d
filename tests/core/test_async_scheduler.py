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


def async_sched(num_blocks=64):
    return Scheduler(KVCacheManager(num_blocks, 4), max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
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

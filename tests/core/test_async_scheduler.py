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


class _FakeRunner:
    """Stands in for the runner: its own computed count per request (reset when a request is
    sent in full), a token after each step that reaches the end of a request's tokens (a
    function of the request and its position: the same under either scheduling), and for a
    pooling request's last chunk a pooled "row" that says how many tokens had run by then."""

    def __init__(self, prompt_len: dict[str, int]):
        self.prompt_len, self.computed, self.outputs = prompt_len, {}, {}

    def __call__(self, so) -> RunnerOutput:
        for nr in so.scheduled_new_reqs:
            self.computed[nr.req_id] = nr.num_computed_tokens
        ids, toks, pooled = list(so.num_scheduled_tokens), [], {}
        for rid in ids:
            self.computed[rid] += so.num_scheduled_tokens[rid]
            pos = self.computed[rid]
            samples = pos >= self.prompt_len[rid]
            toks.append([100 + (pos * 7 + len(rid)) % 50] if samples else [])
            if samples and rid.startswith("pool"):
                pooled[rid] = [float(pos)]
        return RunnerOutput(ids, toks, pooled=pooled)


def _drive(async_scheduling: bool, num_blocks: int) -> tuple[dict, Scheduler]:
    """Pooling requests (two longer than a step) beside generation requests in one scheduler,
    driven as EngineCore.step does (async: N+1 scheduled and dispatched, then N applied)."""
    s = Scheduler(KVCacheManager(num_blocks, 4), max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                  async_scheduling=async_scheduling)
    lens = {"gen-a": 5, "pool-long": 40, "gen-b": 9, "pool-short": 6, "pool-mid": 20}
    for rid, n in lens.items():
        s.add_request(make(rid, n, max_tokens=6) if rid.startswith("gen") else
                      Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=1), pooling=True))
    runner, got, pending = _FakeRunner(lens), {}, None
    for _ in range(200):
        if not (s.has_unfinished_requests() or pending is not None):
            break
        so = s.schedule()
        res = None if so.is_empty else runner(so)
        if not async_scheduling:
            outs = s.update_from_output(so, res) if res is not None else []
        else:
            outs = s.update_from_output(*pending) if pending is not None else []
            pending = None if res is None else (so, res)
        for o in outs:
            tokens, pooled, finish = got.get(o.request_id, ([], None, None))
            got[o.request_id] = (tokens + o.new_token_ids, o.pooled if o.pooled is not None else pooled,
                                 o.finish_reason or finish)
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == s.kv.num_blocks
    return got, s


def test_pooling_beside_generation_under_async_scheduling_gets_the_sync_results():
    """A pooling request's computed count runs ahead under async scheduling (its later chunks are
    scheduled before its earlier ones are applied): it ends at the step that ran its last chunk,
    with that step's pooled row, and every request, pooled or generated, gets what it gets
    under synchronous scheduling, with and without preemptions."""
    for num_blocks in (64, 12):
        sync, _ = _drive(False, num_blocks)
        got, s = _drive(True, num_blocks)
        assert got == sync
        assert {rid: got[rid][1] for rid in got if rid.startswith("pool")} == {
            "pool-long": [40.0], "pool-short": [6.0], "pool-mid": [20.0]}
        assert all(got[rid][2] == "stop" and not got[rid][0] for rid in got if rid.startswith("pool"))
        assert all(len(got[rid][0]) == 6 and got[rid][2] == "length" for rid in ("gen-a", "gen-b"))
        if num_blocks == 12:
            assert s.num_preemptions, "precondition: the small pool never forced a preemption"

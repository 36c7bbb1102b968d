"""The draft model's KV is one more cache kind of the one KV manager: no second block pool,
each draft step addressed through the target's block tables, lookahead slots for the draft's
proposals allocated by the scheduler beside the target's tokens (never at the price of a
preemption), and the one pool whole again once every request has ended."""

from __future__ import annotations

from support.engines import SMALL_ENGINE

from jaxllm import LLM, SamplingParams
from jaxllm.core import kv_cache_manager
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.scheduler import Scheduler
from jaxllm.outputs import RunnerOutput
from jaxllm.request import Request


def request(rid, n, max_tokens=20):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   max_tokens=max_tokens)


def scheduler(num_blocks, budget=32, lookahead=3):
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=False)
    return kv, Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=64,
                         num_lookahead_tokens=lookahead)


def test_a_sampling_request_gets_lookahead_slots_a_prefill_chunk_none():
    kv, s = scheduler(64, budget=4)
    req = request("a", 8)
    s.add_request(req)
    so = s.schedule()                          # the first 4 prompt tokens: samples nothing
    assert so.num_scheduled_tokens == {"a": 4} and len(kv.get_block_ids("a")) == 1
    s.update_from_output(so, RunnerOutput(["a"], [[]]))
    so = s.schedule()                          # the last chunk samples: 8 + 3 positions, 3 blocks
    assert so.num_scheduled_tokens == {"a": 4}
    assert len(kv.get_block_ids("a")) == 3
    assert so.scheduled_cached_reqs.new_block_ids == [kv.get_block_ids("a")[1:]]   # the runner hears of them
    s.update_from_output(so, RunnerOutput(["a"], [[7]], draft_token_ids={"a": [8, 9, 10]}))
    so = s.schedule()                          # verifies 3: 9 + 3 positions, + 3 lookahead = 15
    assert so.scheduled_spec_decode_tokens == {"a": [8, 9, 10]}
    assert len(kv.get_block_ids("a")) == 4


def test_lookahead_takes_only_what_the_step_left_free():
    """Three blocks, two 4-token prompts: both are seated (a block each) and only one gets its
    lookahead block; nothing is preempted for a lookahead."""
    kv, s = scheduler(4)
    a, b = request("a", 4), request("b", 4)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 4, "b": 4} and s.num_preemptions == 0
    assert sorted(len(kv.get_block_ids(r)) for r in "ab") == [1, 2]
    assert kv.num_free_blocks == 0


def test_the_draft_model_runs_on_the_one_kv_manager(tiny_llama, monkeypatch):
    """Building an engine with a draft model makes one block pool; every draft step reads the
    block tables the scheduler gave the target; the pool is whole after the requests end."""
    pools = []
    init = kv_cache_manager.BlockPool.__init__

    def counting(self, *a, **kw):
        pools.append(self)
        init(self, *a, **kw)

    monkeypatch.setattr(kv_cache_manager.BlockPool, "__init__", counting)
    llm = LLM(tiny_llama, **{**SMALL_ENGINE, "precompile": "on-demand"},
              speculative_config={"model": tiny_llama, "num_speculative_tokens": 3, "min_acceptance_rate": 0.0,
                                  "cost_model": False})
    core = llm.llm_engine.core
    assert len(pools) == 1 and pools[0] is core.kv_manager.pool
    draft = core.runner.draft_runner
    run, seen = draft.run_sequences, []

    def checked(sched):
        for rid in sched:
            seen.append(rid)
            assert draft.requests[rid].block_ids == core.kv_manager.get_block_ids(rid)
        return run(sched)

    monkeypatch.setattr(draft, "run_sequences", checked)
    # Two 4-token prompts: one 8-token prefill bucket for the target and the draft, and one
    # verification bucket (2 requests x (1 + 3) tokens); the draft's engine shapes are
    # SMALL_ENGINE's (the plain tiny_llm's programs).  Each request still outgrows its first
    # block (4 + 12 tokens + lookahead > 16), so the tables checked have two blocks.
    prompts = [[5, 6, 7, 8], [40, 41, 42, 43]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert seen and llm.llm_engine.core.scheduler.spec_stats.num_accepted_tokens > 0
    llm.llm_engine.step()
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks

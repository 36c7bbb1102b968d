"""Automatic prefix caching in the KV-cache manager and the scheduler, without a device."""

from __future__ import annotations

from support.scheduler_steps import run_step

from jaxllm.core.kv_cache_manager import ROOT_HASH, KVCacheManager, hash_block
from jaxllm.core.scheduler import Scheduler
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams

BS = 4


def req(rid, tokens, max_tokens=1, salt=None, **sp):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **sp)
    return Request(rid, list(tokens), params, eos_token_ids=(2,), max_tokens=max_tokens, cache_salt=salt)


def sched(num_blocks=64, budget=64, seqs=4, max_len=64, caching=True, **kw):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(kv, max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len, **kw)


def finish(s, *requests):
    """Adds the requests and runs the scheduler until all of them have finished."""
    for r in requests:
        s.add_request(r)
    for _ in range(200):
        if not s.has_unfinished_requests():
            return
        run_step(s)
    raise AssertionError("requests did not finish")


def admit(s, r):
    """Adds ``r`` and runs one step; returns (tokens scheduled, its NewRequestData)."""
    s.add_request(r)
    so, _ = run_step(s)
    new = [nr for nr in so.scheduled_new_reqs if nr.req_id == r.request_id]
    return so.num_scheduled_tokens.get(r.request_id), (new[0] if new else None)


P = list(range(100, 110))       # 10 tokens: two full blocks of 4 and a partial one


def test_hash_is_a_chain_over_parent_tokens_and_salt():
    a = hash_block(ROOT_HASH, [1, 2, 3, 4], None)
    assert a == hash_block(ROOT_HASH, [1, 2, 3, 4], None)            # stable
    assert len(a) == 32
    assert a != hash_block(ROOT_HASH, [1, 2, 3, 5], None)
    assert a != hash_block(ROOT_HASH, [1, 2, 3, 4], "")               # empty salt is not no salt
    assert a != hash_block(ROOT_HASH, [1, 2, 3, 4], "tenant")
    assert hash_block(a, [5, 6, 7, 8], None) != hash_block(ROOT_HASH, [5, 6, 7, 8], None)


def test_hit_reuses_the_cached_prefix_and_computes_the_rest():
    s = sched()
    finish(s, req("a", P + [7, 7, 7]))                  # 13 tokens: 3 full blocks computed
    cached_blocks = s.kv.pool.num_cached_blocks
    assert cached_blocks == 3
    n, nr = admit(s, req("b", P + [1, 2, 3, 4, 5], max_tokens=5))   # shares 10 tokens = 2 full blocks
    assert nr.num_computed_tokens == 8 and n == 15 - 8
    assert s.requests["b"].num_cached_tokens == 8
    assert s.kv.prefix_cache_queries == 13 + 15 and s.kv.prefix_cache_hits == 8


def test_miss_when_the_first_block_differs_even_if_later_blocks_match():
    s = sched()
    finish(s, req("a", [1, 2, 3, 4] + P))
    # Same second and third blocks' tokens as "a", under a different first block: no match.
    n, nr = admit(s, req("b", [9, 9, 9, 9] + P))
    assert nr.num_computed_tokens == 0 and n == 14
    # Same first block, different second: only the first matches.
    n, nr = admit(s, req("c", [1, 2, 3, 4] + [0] + P[1:]))
    assert nr.num_computed_tokens == 4


def test_same_block_tokens_under_a_different_parent_do_not_match():
    X, Q, W, Y = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
    s = sched()
    finish(s, req("a", X + Q + [0]), req("b", W + Y + [0]))   # cached: X, X>Q, W, W>Y
    n, nr = admit(s, req("c", X + Y + [0]))                  # Y's K/V after W is not Y's after X
    assert nr.num_computed_tokens == 4 and n == 5


def test_a_fully_cached_prompt_still_computes_at_least_one_token():
    s = sched()
    aligned = list(range(200, 208))                     # exactly two blocks
    finish(s, req("a", aligned), req("u", P + [5, 5]))  # "u": 12 tokens, three blocks
    n, nr = admit(s, req("b", aligned))
    assert nr.num_computed_tokens == 4 and n == 4       # the last block is recomputed
    n, nr = admit(s, req("c", P + [5, 5]))
    assert nr.num_computed_tokens == 8 and n == 4
    n, nr = admit(s, req("d", P + [5, 5, 6]))           # 13 tokens: three blocks cached, one token left
    assert nr.num_computed_tokens == 12 and n == 1
    finish(s)
    assert [o for o in s.requests] == []


def test_reference_counts_and_freed_blocks_stay_cached():
    s = sched()
    finish(s, req("a", P))
    pool = s.kv.pool
    hit = s.kv.find_cached_prefix(req("x", P))
    assert len(hit) == 2 and all(pool.ref_count(b) == 0 for b in hit)
    s.add_request(req("b", P, max_tokens=5))
    s.add_request(req("c", P, max_tokens=5))
    run_step(s)
    assert [pool.ref_count(b) for b in hit] == [2, 2]
    assert s.kv.get_block_ids("b")[:2] == hit == s.kv.get_block_ids("c")[:2]
    s.abort_requests(["b"])
    assert [pool.ref_count(b) for b in hit] == [1, 1]
    s.abort_requests(["c"])
    assert [pool.ref_count(b) for b in hit] == [0, 0]
    assert s.kv.num_free_blocks == s.kv.num_blocks       # free, and still cached:
    assert s.kv.find_cached_prefix(req("y", P)) == hit


def test_eviction_is_least_recently_used():
    # 8 usable blocks of 4.  "a" then "b" fill and free 3 blocks each (2 full ones cached).
    s = sched(num_blocks=9)
    A, B = list(range(300, 310)), list(range(400, 410))
    finish(s, req("a", A))
    finish(s, req("b", B))
    assert s.kv.pool.num_cached_blocks == 4
    # 16 new tokens take 4 blocks: the 2 never used, then a's tail (partial) and a's second block.
    finish(s, req("c", list(range(500, 516))))
    assert len(s.kv.find_cached_prefix(req("qa", A))) == 1      # a's first block survived
    assert len(s.kv.find_cached_prefix(req("qb", B))) == 2      # b (freed later) untouched
    # Touching b's blocks makes them the most recently used: a's last block goes next.
    finish(s, req("b2", B))
    finish(s, req("d", list(range(600, 604))))
    assert len(s.kv.find_cached_prefix(req("qa", A))) == 0
    assert len(s.kv.find_cached_prefix(req("qb", B))) == 2


def test_cache_salt_isolates_tenants():
    s = sched()
    finish(s, req("a", P, salt="tenant-1"))
    assert admit(s, req("none", P))[1].num_computed_tokens == 0
    assert admit(s, req("other", P, salt="tenant-2"))[1].num_computed_tokens == 0
    assert admit(s, req("same", P, salt="tenant-1"))[1].num_computed_tokens == 8


def test_blocks_are_cached_only_once_computed():
    # The runner may write a block's K/V in the very step another request would read it (the
    # Pallas kernel writes K/V inside the attention grid), so a block becomes a hit only after
    # the step that computed it.
    s = sched(budget=10)
    s.add_request(req("a", P + [1, 1]))
    run_step(s)                                           # a computed 10 tokens: two full blocks
    n, nr = admit(s, req("b", P + [1, 1, 3, 3, 3]))       # a computes its third block in this step
    assert nr.num_computed_tokens == 8 and n == 7


def test_prompt_logprobs_requests_compute_their_whole_prompt():
    s = sched()
    finish(s, req("a", P))
    n, nr = admit(s, req("b", P, prompt_logprobs=1))
    assert nr.num_computed_tokens == 0 and n == 10


def test_disabled_caching_never_hits():
    s = sched(caching=False)
    finish(s, req("a", P))
    n, nr = admit(s, req("b", P))
    assert nr.num_computed_tokens == 0 and s.kv.pool.num_cached_blocks == 0
    assert s.kv.prefix_cache_queries == 0


def test_outputs_report_cached_tokens():
    s = sched()
    finish(s, req("a", P))
    s.add_request(req("b", P))
    _, outs = run_step(s)
    assert [(o.request_id, o.num_cached_tokens) for o in outs] == [("b", 8)]


def test_preempted_request_resumes_from_its_cached_blocks():
    # 6 usable blocks of 4: two requests of 8 prompt tokens growing to 20 tokens cannot both fit.
    s = sched(num_blocks=7, budget=32, max_len=24)
    s.add_request(req("old", list(range(10, 18)), max_tokens=12))
    s.add_request(req("new", list(range(30, 38)), max_tokens=12))
    run_step(s)
    while not s.num_preemptions:
        run_step(s)
    victim = s.requests["new"]
    assert victim.num_computed_tokens == 0
    resent = None
    for _ in range(100):
        expected = victim.all_token_ids
        so, _ = run_step(s)
        resent = next((nr for nr in so.scheduled_new_reqs if nr.req_id == "new"), None)
        if resent:
            break
    assert resent is not None, "the preempted request was never re-admitted within 100 steps"
    assert resent.token_ids == expected
    assert resent.num_computed_tokens > 0 and resent.num_computed_tokens % BS == 0
    assert so.num_scheduled_tokens["new"] == len(expected) - resent.num_computed_tokens
    finish(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks

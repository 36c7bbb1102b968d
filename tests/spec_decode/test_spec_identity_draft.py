"""Speculation with a draft model returns exactly the tokens plain decoding returns: the target
as its own draft and another tiny model, over the identity workload
(tests/support/spec_workload.py); the draft's cache inside the KV budget; a pool too small for
the batch.  The target as its own draft runs only in the small pool (the engine's pool with
blocks held out, so its programs stay those of every other engine here): its identity,
near-full acceptance and whole pool are asserted there, over the whole workload; another
model as the draft runs in the ordinary pool.  Both generating engines have SMALL_ENGINE's
shapes and k = 3: the target's programs are the same in both, and the tiny Llama as a draft
runs the programs of the session's plain ``tiny_llm`` (persistent-cache hits).  The ngram and
oracle-proposer cases are tests/spec_decode/test_spec_identity.py (one file each, so that the
two halves can run on two workers)."""

from __future__ import annotations

from support.engines import SMALL_ENGINE
from support.spec_workload import (plain_outputs, small_pool, snapshot, tokens,  # noqa: F401  (plain_outputs: fixture)
                                    workload)

from jaxllm import LLM


def test_other_draft_model_batch_equals_plain_decoding(tiny_llama, tiny_checkpoints, plain_outputs):
    """A draft model run by the engine's machinery: another tiny model (it mostly proposes
    wrong tokens) equals plain decoding.  The target itself as its own draft (it proposes what
    the target will draw, at every temperature: the same noise) is
    test_draft_model_with_a_full_pool_keeps_outputs_equal, over the same whole workload."""
    llm = LLM(tiny_llama, **{**SMALL_ENGINE, "precompile": "on-demand"},
              speculative_config={"model": tiny_checkpoints["qwen3_qk_norm"], "num_speculative_tokens": 3, "min_acceptance_rate": 0.0,
                                  "cost_model": False})
    prompts, params = workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == tokens(plain_outputs)
    drafts, proposed, accepted = snapshot(llm)
    assert drafts > 0 and accepted < 0.5 * proposed, (drafts, accepted, proposed)
    # The one KV pool (the draft's pages are in its blocks) is whole again once the runner
    # has heard every request ended (the next step tells it).
    llm.llm_engine.step()
    kv = llm.llm_engine.core.kv_manager
    assert kv.num_free_blocks == kv.num_blocks


def draft_llm(tiny_llama, **engine):
    return LLM(tiny_llama, **{**SMALL_ENGINE, "precompile": "on-demand", **engine},
               speculative_config={"model": tiny_llama, "num_speculative_tokens": 3, "min_acceptance_rate": 0.0,
                                   "cost_model": False})


def test_draft_model_cache_is_inside_the_kv_budget(tiny_llama):
    """--kv-cache-memory-bytes bounds the target's and the draft's caches together: the bytes
    both runners allocated, read back from their arrays, are within the budget, and the draft
    holds as many blocks as the target."""
    budget = 3 * (1 << 20) + 12345
    llm = draft_llm(tiny_llama, kv_cache_memory_bytes=budget, num_blocks_override=None)
    core = llm.llm_engine.core
    target, draft = core.runner.kv_cache_bytes(), core.runner.draft_runner.kv_cache_bytes()
    assert draft > 0 and target + draft <= budget
    assert core.runner.draft_runner.num_blocks == core.runner.num_blocks
    assert budget - (target + draft) < core.resolved.kv.bytes_per_block   # the budget is used


def test_draft_model_with_a_full_pool_keeps_outputs_equal(tiny_llama, plain_outputs):
    """A pool too small for the batch: the target preempts, and a request whose lookahead
    slots did not fit does not propose that step; nothing fails, the outputs equal plain
    decoding, and the one pool is whole at the end."""
    llm = draft_llm(tiny_llama)
    # The whole workload (every kind of sampling parameter) overflows the 8 blocks left free;
    # each output is its own plain run's (a per-request guarantee), and preemption and
    # left-out lookahead really happen (asserted).  This is also the target-as-its-own-draft
    # identity test.
    prompts, params = workload()
    core = llm.llm_engine.core
    with small_pool(llm, 8):
        outs = llm.generate(prompts, params, use_tqdm=False)
    proposer = core.runner.speculation.proposer
    assert core.scheduler.num_preemptions > 0 and proposer.num_left_out > 0
    assert tokens(outs) == tokens(plain_outputs)
    drafts, proposed, accepted = snapshot(llm)
    assert drafts > 0 and accepted > 0.9 * proposed      # the target as its own draft
    llm.llm_engine.step()
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks

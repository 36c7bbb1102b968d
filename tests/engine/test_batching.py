"""Continuous batching is real: batched outputs equal each request run alone, including
under chunked prefill and under preemption from a KV pool that is too small."""

from __future__ import annotations

import pytest

from support.batch_workload import record_schedules, workload
from support.engines import SMALL_ENGINE

from jaxllm import LLM


@pytest.fixture(scope="module")
def solo_outputs(tiny_llm):
    prompts, params = workload()
    return [tiny_llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]


def test_batched_equals_solo(tiny_llm, solo_outputs):
    prompts, params = workload()
    seen, restore = record_schedules(tiny_llm)
    try:
        outs = tiny_llm.generate(prompts, params, use_tqdm=False)
    finally:
        restore()
    assert [o.outputs[0].token_ids for o in outs] == solo_outputs
    # The schedule really batched: four sequences in a step, and prompts split into chunks.
    assert max(len(so.num_scheduled_tokens) for so in seen) == SMALL_ENGINE["max_num_seqs"]
    assert max(so.total_num_scheduled_tokens for so in seen) <= SMALL_ENGINE["max_num_batched_tokens"]
    chunked = [so for so in seen for nr in so.scheduled_new_reqs
               if so.num_scheduled_tokens[nr.req_id] < len(nr.token_ids)]
    assert chunked, "no prompt was split into chunks"
    mixed = [so for so in seen if any(n == 1 for n in so.num_scheduled_tokens.values())
             and any(n > 1 for n in so.num_scheduled_tokens.values())]
    assert mixed, "no step mixed decodes with a prefill chunk"


def test_preemption_keeps_outputs_equal(tiny_llama, solo_outputs):
    # 9 blocks of 16 tokens (one 128-token sequence fits): four running requests do not.
    llm = LLM(tiny_llama, **{**SMALL_ENGINE, "num_blocks_override": 10, "max_model_len": 128})
    prompts, params = workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    core = llm.llm_engine.core
    assert core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == solo_outputs
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks

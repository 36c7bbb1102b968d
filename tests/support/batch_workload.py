"""A mixed batch for the tiny Llama (prompt lengths and output lengths drawn from a seed) and a
recorder of the schedules an engine runs."""

from __future__ import annotations

import numpy as np

from jaxllm import SamplingParams


def workload(n=16, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(3, 5000, size=int(L)).tolist()}
               for L in rng.integers(2, 70, size=n)]
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(4, 30, size=n)]
    return prompts, params


def record_schedules(llm):
    seen = []
    runner = llm.llm_engine.core.runner
    execute = runner.execute

    def recording(so):
        seen.append(so)
        return execute(so)

    runner.execute = recording
    return seen, lambda: setattr(runner, "execute", execute)

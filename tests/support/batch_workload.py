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
    """Records every ``SchedulerOutput`` the engine's scheduler makes (synchronous or async
    scheduling alike: async steps go to the runner's ``dispatch``, not ``execute``).
    Returns the list and a function that stops recording."""
    seen = []
    scheduler = llm.llm_engine.core.scheduler
    schedule = scheduler.schedule

    def recording():
        so = schedule()
        seen.append(so)
        return so

    scheduler.schedule = recording
    return seen, lambda: delattr(scheduler, "schedule")

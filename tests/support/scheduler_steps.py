"""Drives a Scheduler without a device: one step whose finished prompts sample a given token."""

from __future__ import annotations

from jaxllm.outputs import RunnerOutput


def run_step(s, token=7, tokens=None):
    """One step where every request that completes its tokens samples ``token``."""
    so = s.schedule()
    ids, sampled = [], []
    for rid, n in so.num_scheduled_tokens.items():
        req = s.requests[rid]
        ids.append(rid)
        done = req.num_computed_tokens + n == req.num_tokens
        sampled.append([tokens.get(rid, token) if tokens else token] if done else [])
    outs = s.update_from_output(so, RunnerOutput(ids, sampled))
    return so, outs

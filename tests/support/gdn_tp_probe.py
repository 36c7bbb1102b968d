"""Qwen3-Next / Qwen3.5 (hybrid GDN) sharded over 1 and 2 simulated CPU devices (test_gdn_tp.py).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m support.gdn_tp_probe OUT.npz CKPT...

For each checkpoint and tp in (1, 2): tp_probe.run's prompt logits and 32 greedy decode steps
through the paged K/V and one GDN state slot, the shard shapes of the weights and of every
cache array, and the all-gathers in the compiled step; Qwen3.5 at tp=2 again with the Pallas
kernels (the GDN decode kernel per device under shard_map); and Qwen3-Next's tokens from the
engine at tp=2 (every bucket compiled in the sharded AOT warm-up, chunked prefill carrying
the sharded states, the strict compile guard: nothing compiled after warm-up).
"""

from __future__ import annotations

import os

import numpy as np

from support.tp_probe import engine_tokens, probe_main, run

PROMPT = np.random.default_rng(1).integers(0, 320, size=24).astype(np.int32)   # the tiny vocabulary


def measure(path):
    name = os.path.basename(path)
    runs = [(1, "xla"), (2, "xla")] + ([(2, "pallas")] if name == "Qwen3_5ForCausalLM" else [])
    for tp, attention in runs:
        key = f"{name}/tp{tp}" + ("/pallas" if attention == "pallas" else "")
        yield key, run(path, tp, False, scan=False, attention=attention, prompt=PROMPT)
    if name == "Qwen3NextForCausalLM":
        yield f"engine/{name}/tp2", {"tokens": engine_tokens(path, 2, scan=False, prompt=PROMPT, precompile="all")}


if __name__ == "__main__":
    probe_main(measure)

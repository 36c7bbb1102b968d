"""Qwen3-Next / Qwen3.5 (hybrid GDN) sharded over 1 and 2 simulated CPU devices (test_gdn_tp.py).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m support.gdn_tp_probe OUT.npz CKPT...

For each checkpoint: tp_probe.run's prompt logits and 32 greedy decode steps through the
paged K/V and one GDN state slot at tp=1 and at tp=2 (``RUNS``), the shard shapes of the
weights and of every cache array, and the all-gathers in the compiled step; and Qwen3-Next's
tokens from the engine at tp=2 (chunked prefill carrying the sharded states, each bucket the
steps run compiled ahead of time with the sharded cache, the strict compile guard: nothing
traced or compiled twice).
"""

from __future__ import annotations

import os

import numpy as np

from support.tp_probe import engine_tokens, probe_main, run

PROMPT = np.random.default_rng(1).integers(0, 320, size=24).astype(np.int32)   # the tiny vocabulary


# The tp=2 runs, one backend per checkpoint (each run is a compile): Qwen3-Next on the XLA path
# (the jitted gated delta rule per device), Qwen3.5 with the Pallas kernels (the GDN decode
# kernel per device under shard_map).  The two layouts of the projections (fused q/k/v/z and
# b/a; Qwen3.5's regrouped q/k/v, z, b, a) are outside the kernel: each is split and checked
# (shards, only the logits gathered) on its own checkpoint's run.
RUNS = {"Qwen3NextForCausalLM": [(1, "xla"), (2, "xla")],
        "Qwen3_5ForCausalLM": [(1, "xla"), (2, "pallas")]}


def measure(path):
    name = os.path.basename(path)
    for tp, attention in RUNS[name]:
        key = f"{name}/tp{tp}" + ("/pallas" if attention == "pallas" else "")
        yield key, run(path, tp, False, scan=False, attention=attention, prompt=PROMPT)
    if name == "Qwen3NextForCausalLM":
        yield f"engine/{name}/tp2", {"tokens": engine_tokens(path, 2, scan=False, prompt=PROMPT)}


if __name__ == "__main__":
    probe_main(measure)

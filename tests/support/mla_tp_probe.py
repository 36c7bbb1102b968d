"""DeepSeek-V2 / V3 (MLA) sharded over 1 and 2 simulated CPU devices (test_mla_tp.py).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m support.mla_tp_probe OUT.npz CKPT...

For each checkpoint and tp in (1, 2): tp_probe.run's prompt logits and 32 greedy decode steps
with the shard shapes it saw (V3 unrolled: its dense first layer; V2 stacked), and V2's tokens
from the engine at tp=2 (chunked prefill into the replicated latent pages; each bucket the steps
run compiled ahead of time with the sharded cache, strict compile guard).  The every-bucket
warm-up at tp=2 is the multi-host engine's (test_multihost.py).
"""

from __future__ import annotations

import os

from support.tp_probe import engine_tokens, probe_main, run


def measure(path):
    name = os.path.basename(path)
    scan = name != "deepseek_v3"        # its dense first layer and MoE layers do not stack
    for tp in (1, 2):
        yield f"{name}/tp{tp}", run(path, tp, False, scan=scan)
    if scan:
        yield f"engine/{name}/tp2", {"tokens": engine_tokens(path, 2)}


if __name__ == "__main__":
    probe_main(measure)

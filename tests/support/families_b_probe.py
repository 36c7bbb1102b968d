"""Phi-3 and GLM-4-MoE sharded over 1 and 2 simulated CPU devices (test_families_b_tp.py).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m support.families_b_probe OUT.npz CKPT...

For each checkpoint and tp in (1, 2): tp_probe.run's prompt logits (one token per step: Phi-3's
24-token prompt in its short-factor regime) and 32 greedy decode steps (crossing 32 positions:
the long factors), with the shard shapes it saw.  No engine: the serving path at tp=2 is
family-blind (test_tensor_parallel.py runs it; each family's engine at tp=1 against
transformers: tests/models/test_families_b.py), and an engine is a probe's dearest piece.
"""

from __future__ import annotations

import os

from support.tp_probe import probe_main, run


def measure(path):
    name = os.path.basename(path)
    scan = name != "glm4_moe"        # its dense first layer and MoE layers do not stack
    for tp in (1, 2):
        yield f"{name}/tp{tp}", run(path, tp, False, scan=scan)


if __name__ == "__main__":
    probe_main(measure)

"""DeepSeek-V2 / V3 (MLA) sharded over 1 and 2 simulated CPU devices (test_mla_tp.py).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python mla_tp_probe.py OUT.npz CKPT...

For each checkpoint and tp in (1, 2): tp_probe.run's prompt logits and 32 greedy decode steps
with the shard shapes it saw (V3 unrolled: its dense first layer; V2 stacked), and V2's tokens
from the engine at tp=2 (every bucket compiled in the sharded AOT warm-up, strict compile guard).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_probe import engine_tokens, run


def main():
    from jaxllm.config import default_cache_dir
    from jaxllm.runner import compile as cc
    cc.enable_persistent_cache(os.path.join(default_cache_dir(), "xla"))
    out, paths = sys.argv[1], sys.argv[2:]
    arrays, meta = {}, {}
    for path in paths:
        name = os.path.basename(path)
        scan = name != "deepseek_v3"        # its dense first layer and MoE layers do not stack
        for tp in (1, 2):
            r = run(path, tp, False, scan=scan)
            arrays[f"{name}/tp{tp}"] = r.pop("logits")
            meta[f"{name}/tp{tp}"] = r
            print(name, tp, r["tokens"][:6], r["shards"], flush=True)
        if scan:
            meta[f"engine/{name}/tp2"] = {"tokens": engine_tokens(path, 2, precompile="all")}
    np.savez(out, **arrays)
    with open(out + ".json", "w") as f:
        json.dump(meta, f)


if __name__ == "__main__":
    main()

"""Gemma 2/3 and GPT-OSS sharded over 1 and 2 simulated CPU devices; writes what it saw.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m support.tp_families_probe CKPT_ROOT OUT.npz \
        NAME,... [VL_CKPT,...]

Run in its own process by test_tp_families.py (the device count is fixed before JAX starts).
For each checkpoint: the prompt's logits and 32 greedy tokens through the paged cache at
tp=1 and tp=2 (``tp_probe.run``, unrolled layers: the layers' windows differ), at tp=2 also
with the Pallas kernel per device under shard_map (``PALLAS``; GPT-OSS's sinks split with the
heads).  No engine (``PALLAS``'s comment says why) for the text families; the vision-language
checkpoints (``VL_CKPT``: a folder named ``gemma3`` or ``qwen3_5``) run the engine with an image
at tp=2 (``vision_tp_probe.measure``; in this process, which has loaded transformers and JAX once).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from support.tp_probe import run
from support.vision_tp_probe import measure as measure_vision

# Each run is a compile (the Pallas ones in interpret mode, the dearest), so each family runs
# what it alone brings.  The Pallas kernel per device: GPT-OSS (its sinks split with the heads)
# and Gemma 2 (soft-cap, sliding window and query scale inside shard_map); Gemma 3 brings no
# kernel feature Gemma 2 does not (its qk-norm and local rope base are outside the kernel).
# No engine (an engine is a probe's dearest piece, three programs): the serving path at tp=2
# is family-blind (sharded AOT compile, donated sharded cache, sampler, chunked prefill) and
# runs on the families whose cache it lays out differently (test_gdn_tp.py, test_mla_tp.py),
# on Qwen3-MoE with expert parallelism (test_tensor_parallel.py) and on the tiny Llama
# (test_multihost.py); what a family brings to tp=2 is its sharded forward, the runs here
# (every head's sinks, soft-cap, window and q/k norm on the split heads); each family's engine
# (chunked prefill through the window, preemption, prefix caching) at tp=1 against
# transformers: tests/models/test_gemma.py, test_gpt_oss.py.
PALLAS = ("gemma2", "gpt_oss")


def main():
    from jaxllm.config import default_cache_dir
    from jaxllm.runner import compile as cc
    cc.enable_persistent_cache(os.path.join(default_cache_dir(), "xla"))
    root, out, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    arrays, meta = {}, {}
    for name in names:
        path = os.path.join(root, name)
        runs = [(f"{name}/tp1", 1, "xla"), (f"{name}/tp2", 2, "xla")]
        runs += [(f"{name}/tp2/pallas", 2, "pallas")] if name in PALLAS else []
        for key, tp, attention in runs:
            r = run(path, tp, False, scan=False, attention=attention)
            arrays[key] = r.pop("logits")
            meta[key] = r
            print(key, r["tokens"][:6], r["shards"].get("q"), flush=True)
    for path in sys.argv[4].split(",") if len(sys.argv) > 4 else ():
        name = os.path.basename(path)
        rows, meta[f"vision/{name}"] = measure_vision(path)
        arrays.update({f"vision/{name}/{k}": v for k, v in rows.items()})
        print(f"vision/{name}", meta[f"vision/{name}"]["tokens"][:6], flush=True)
    np.savez(out, **arrays)
    with open(out + ".json", "w") as f:
        json.dump(meta, f)


if __name__ == "__main__":
    main()

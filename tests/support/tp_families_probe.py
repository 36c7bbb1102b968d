"""Gemma 2/3 and GPT-OSS sharded over 1 and 2 simulated CPU devices; writes what it saw.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m support.tp_families_probe CKPT_ROOT OUT.npz

Run in its own process by test_tp_families.py (the device count is fixed before JAX starts).
For each checkpoint: the prompt's logits and 32 greedy tokens through the paged cache at
tp=1 and tp=2 (``tp_probe.run``, unrolled layers: the layers' windows differ), at tp=2 also
with the Pallas kernel per device under shard_map (``PALLAS``; GPT-OSS's sinks split with the
heads), and the engine's tokens at tp=2 (``ENGINE``: chunked prefill through the sliding
window, the sharded AOT compile under the strict compile guard).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from support.tp_probe import PROMPT, STEPS, run

# Each run is a compile (the Pallas ones in interpret mode, the dearest), so each family runs
# what it alone brings.  The Pallas kernel per device: GPT-OSS (its sinks split with the heads)
# and Gemma 2 (soft-cap, sliding window and query scale inside shard_map); Gemma 3 brings no
# kernel feature Gemma 2 does not (its qk-norm and local rope base are outside the kernel).
# The engine (serving path at tp=2, family-blind: an engine is the probe's dearest piece):
# Gemma 3, whose alternating sliding/global layers it prefills in chunks.  Gemma 2's and
# GPT-OSS's sharded forwards are their tp2 runs (every head's sinks, soft-cap and window on the
# split heads); the serving path at tp=2 on other families: test_tensor_parallel.py (Llama,
# Qwen3-MoE with expert parallelism), test_gdn_tp.py, test_mla_tp.py.
PALLAS = ("gemma2", "gpt_oss")
ENGINE = ("gemma3",)


def engine_tokens(path: str, tp: int) -> list[int]:
    from jaxllm import LLM, SamplingParams
    llm = LLM(path, skip_tokenizer_init=True, tensor_parallel_size=tp, max_num_seqs=1, max_num_batched_tokens=8,
              max_model_len=64, dtype="float32", strict_compile_guard=True, show_progress=False)
    out = llm.generate([{"prompt_token_ids": PROMPT.tolist()}],
                       SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


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
        if name in ENGINE:
            meta[f"engine/{name}/tp2"] = {"tokens": engine_tokens(path, 2)}
    np.savez(out, **arrays)
    with open(out + ".json", "w") as f:
        json.dump(meta, f)


if __name__ == "__main__":
    main()

"""Run by test_compile.py in a fresh process: builds an engine with default KV sizing and
every bucket compiled, prints its warm-up counts as JSON, one line per start.

``python -m support.warmup_probe MODEL CACHE_DIR FREE_BYTES [FREE_BYTES_WITHOUT_SAVED_PROGRAMS]``:
``FREE_BYTES`` stands in for the free memory the process sees, so two probes can see different
amounts, as two starts of a server do.  With the fourth argument, a second engine starts in
the same process after the saved programs (``CACHE_DIR/programs``) are deleted: JAX's
persistent cache alone must then load every program (a process start costs more than the
check, so the two checks of a warm cache share one)."""

import json
import shutil
import sys

from jaxllm.core import kv_budget

FREE = {"bytes": int(sys.argv[3])}
kv_budget._meminfo_available = lambda *a: FREE["bytes"]
kv_budget.cgroup_room_bytes = lambda *a: None

from jaxllm import LLM  # noqa: E402
from jaxllm.runner import compile as cc  # noqa: E402

model, cache_dir = sys.argv[1], sys.argv[2]
cc.install_listeners()


def start() -> dict:
    before = cc.counts()
    # Two token buckets (1, 2): what is checked, every program loaded and none compiled by a
    # second start, does not depend on how many there are; each bucket compiled is seconds.
    llm = LLM(model, max_num_seqs=2, max_num_batched_tokens=2, max_model_len=256, dtype="float32",
              compile_cache_dir=cache_dir, show_progress=False, strict_compile_guard=True, precompile="all")
    after = cc.counts()
    runner = llm.llm_engine.core.runner
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)[0].outputs[0].token_ids
    return {"delta": {k: after[k] - before[k] for k in after}, "num_blocks": runner.num_blocks,
            "programs": len(runner.buckets) + len({S for _, S in runner.buckets}),
            "compiled": runner.compiler.compiled, "loaded": runner.compiler.loaded, "tokens": out}


print(json.dumps(start()), flush=True)
if len(sys.argv) > 4:
    # Without the saved programs (and what JAX's persistent cache loads is not saved:
    # program_cache.ProgramCache.compile).
    shutil.rmtree(f"{cache_dir}/programs")
    FREE["bytes"] = int(sys.argv[4])
    print(json.dumps(start()), flush=True)

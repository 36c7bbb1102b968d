"""Run by test_compile.py in a fresh process: builds an engine, prints its warm-up compile counts as JSON."""

import json
import sys

from jaxllm import LLM
from jaxllm.runner import compile as cc

model, cache_dir = sys.argv[1], sys.argv[2]
cc.install_listeners()
before = cc.counts()
llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, dtype="float32",
          compile_cache_dir=cache_dir, show_progress=False, strict_compile_guard=True)
after = cc.counts()
out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)[0].outputs[0].token_ids
print(json.dumps({"delta": {k: after[k] - before[k] for k in after},
                  "buckets": len(llm.llm_engine.core.runner.buckets),
                  "samplers": len(llm.llm_engine.core.runner._samplers), "tokens": out}))

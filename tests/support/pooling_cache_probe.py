"""Run by tests/pooling/test_embed.py in a fresh process: an encoder's pooling engine started
with every program built (``precompile="all"``, as a server starts it) on a persistent compile
cache; prints its programs, the process's persistent-cache hits and misses, and one vector.

``python -m support.pooling_cache_probe FOLDER CACHE_DIR``"""

import json
import sys

from jaxllm import LLM
from jaxllm.runner import compile as cc

folder, cache_dir = sys.argv[1:3]
llm = LLM(folder, runner="pooling", precompile="all", compile_cache_dir=cache_dir, max_num_batched_tokens=256,
          max_num_seqs=8)
counts = cc.counts()
vector = llm.embed(["the cat sat on the mat"])[0].outputs.embedding
print(json.dumps({"programs": len(llm.pooling_engine.runner._compiled), "cache_hits": counts["cache_hits"],
                  "cache_misses": counts["cache_misses"], "vector": vector}))

"""Run by tests/runner/test_production_flags.py in a fresh process whose XLA_FLAGS lack the
suite's (support.probes.production_env): the tiny model's greedy tokens and logprobs as a
user's process compiles them.

``python -m support.production_flags_probe MODEL CACHE_DIR OUT_JSON``"""

import json
import os
import sys

from support.engines import ONE_SHOT_ENGINE
from support.production_flags import PROMPTS, run

from jaxllm import LLM

model, cache_dir, out = sys.argv[1:4]
llm = LLM(model, **{**ONE_SHOT_ENGINE, "compile_cache_dir": cache_dir})   # a fresh cache: compiled here
with open(out, "w") as f:
    json.dump({"xla_flags": os.environ.get("XLA_FLAGS", ""), **run(llm, PROMPTS)}, f)

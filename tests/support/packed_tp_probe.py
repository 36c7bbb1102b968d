"""Run by test_packed_tp.py in a subprocess with 2 simulated CPU devices: the engine on
packed GGUF files at tp=1 and tp=2; writes tokens, logprobs, shard shapes and the step buckets
compiled as JSON."""

from __future__ import annotations

import json
import os
import sys

from jaxllm import LLM, SamplingParams
from support.engines import ONE_SHOT_ENGINE

# Every step is one program, bucket (2, 2) (each a compile on packed weights): the two one-token
# prompts prefill together in the first step, then both rows decode together and end together.
# tp=2 against tp=1 is per token, 8 each.  How a step's tokens are scheduled (a prefill chunk
# beside a decode, a longer chunk) is not seen by the packed matmul, whose rows are the step's
# tokens; chunked prefill at tp=2 is the engine runs of tests/parallel/.
PROMPTS = [[400], [1000]]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
# Two rows of 2 tokens per step (buckets (1, 1) and (2, 2); only (2, 2) runs) and 64 positions,
# not ONE_SHOT_ENGINE's 4 rows, 32 tokens and 256 positions.
ENGINE = {**ONE_SHOT_ENGINE, "max_num_seqs": 2, "max_num_batched_tokens": 2, "max_model_len": 64}


def main():
    out_path, paths = sys.argv[1], sys.argv[2:]
    res = {}
    for path in paths:
        for tp in (1, 2):
            # float32 activations on one device too (auto rounds Q4_1's to int16 on a CPU
            # without AVX-512; the sharded run's XLA dot does not).  Only the buckets the two
            # prompts run are compiled (the sharded every-bucket warm-up: tests/parallel/).
            llm = LLM(path, **ENGINE, skip_tokenizer_init=True, tensor_parallel_size=tp,
                      cpu_matmul="native" if tp == 1 else "auto")
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
            runner = llm.llm_engine.core.runner
            layer = runner.params["layers"]
            layer = layer[0] if isinstance(layer, list) else layer
            shards = {name: {f: list(getattr(w, f).sharding.shard_shape(getattr(w, f).shape))
                             for f in ("d", "m", "qs") if getattr(w, f, None) is not None}
                      for name, w in layer.items() if hasattr(w, "type_name")}
            res[f"{os.path.basename(path)}/tp{tp}"] = {
                "tokens": [o.outputs[0].token_ids for o in outs],
                "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                             for o in outs],
                "shards": shards,
                "buckets": [list(b) for b in runner.buckets if runner.compiler.ready(b)]}
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()

"""One host of a two-process JAX cluster running the engine on a tiny checkpoint.

    python -m support.multihost_probe CKPT PORT HOST_INDEX OUT.json

Both processes start the same engine (tensor parallel over the cluster's two CPU devices,
one per process).  Host 0 generates and writes the tokens to OUT.json, then releases host
1, which follows host 0's steps until then.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from jaxllm import LLM, SamplingParams

PROMPT = np.random.default_rng(1).integers(3, 5000, size=24).tolist()


def main():
    path, port, host, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    llm = LLM(path, skip_tokenizer_init=True, tensor_parallel_size=2, num_hosts=2, host_index=host,
              distributed_coordinator=f"127.0.0.1:{port}", max_num_seqs=1, max_num_batched_tokens=4,
              max_model_len=64, dtype="float32", scan_layers=True, strict_compile_guard=True, show_progress=False)
    import jax
    assert jax.process_count() == 2 and jax.local_device_count() == 1, (jax.process_count(), jax.local_device_count())
    if host == 0:
        outs = llm.generate([{"prompt_token_ids": PROMPT}],
                            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        tokens = list(outs[0].outputs[0].token_ids)
        llm.shutdown()
        with open(out, "w") as f:
            json.dump({"tokens": tokens, "devices": jax.device_count()}, f)
    else:
        llm.follow()
        print("host 1: released", flush=True)


if __name__ == "__main__":
    main()

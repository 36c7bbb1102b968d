"""Runs one batch of two adapters and the base through the LoRA engine at tp=2 on two
simulated CPU devices; writes the tokens and the shard shapes of the slot arrays.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m support.lora_tp_probe OUT.npz BASE A4 B8 C8

Run in its own process by tests/parallel/test_lora_tp.py (the device count is fixed before
JAX starts).  The engine runs with the strict compile guard, and a third adapter evicts one
from its slot after the first batch: loading an adapter into a sharded slot compiles nothing.
(The tp=1 engine is compared with peft on the same builders in tests/lora/test_engine.py: a
tp=1 engine here would only cost its compiles.)
"""

from __future__ import annotations

import json
import sys

from jaxllm import LLM, LoRARequest, SamplingParams

N = 8
PROMPTS = [[17, 402, 33, 1290, 7], [5, 812, 44, 3001, 2, 90, 613, 11, 27, 4000, 3]]
ITEMS = ((None, 0), ("a4", 1), ("b8", 0))
"""(adapter, prompt index): the batch the engine runs."""


def batch(llm: LLM, loras: dict, items) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for _, i in items],
                        SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                        lora_request=[loras.get(n) for n, _ in items], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    out, base, *adapters = sys.argv[1:]
    loras = {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(zip(("a4", "b8", "c8"), adapters))}
    llm = LLM(base, skip_tokenizer_init=True, tensor_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=64, dtype="float32", scan_layers=True, cpu_matmul="xla", attention_backend="xla",
              enable_lora=True, max_loras=2, max_lora_rank=8, strict_compile_guard=True, show_progress=False)
    meta = {"tp2": batch(llm, loras, ITEMS), "evicting": batch(llm, loras, (("c8", 1),))}
    slots = llm.llm_engine.core.runner.lora_slots
    w = slots.weights   # after the loads (each donates the last); a param's A: its group's array
    ab = {n: (w["A"][slots.group_of(n)], w["B"][n]) for n in slots.targets}
    meta |= {"shards": {n: [list(a.addressable_shards[0].data.shape) for a in pair] for n, pair in ab.items()},
             "full": {n: [list(a.shape) for a in pair] for n, pair in ab.items()}}
    with open(out, "w") as f:
        json.dump(meta, f)


if __name__ == "__main__":
    main()

"""Greedy agreement of the quantized KV cache (``--kv-cache-dtype``) with the model-dtype cache
on the built-in SmolLM2-135M-Instruct.

    python bench/kv_quant_agreement.py                       # auto vs int8, fp8, fp8_e5m2
    python bench/kv_quant_agreement.py --max-tokens 64 --kv-cache-dtypes int8

Each engine generates ``--max-tokens`` greedy tokens (``ignore_eos``) for the same chat
prompts; per prompt the number of tokens equal before the first divergence from the
``auto`` run is printed, then the mean, the prompts that agree in full, and the KV
capacity each engine's budget holds (the start-up line's tokens).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxllm import LLM, SamplingParams  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers greater than ten.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning a new language.",
    "What does a CPU do?",
    "Translate 'good morning' into Spanish.",
]


def agreement(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first divergence."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["int8", "fp8", "fp8_e5m2"])
    p.add_argument("--dtype", default="auto", help="the model dtype (auto: float32 on CPU)")
    args = p.parse_args(argv)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    runs, capacity = {}, {}
    for kvd in ["auto", *args.kv_cache_dtypes]:
        t0 = time.perf_counter()
        llm = LLM(dtype=args.dtype, kv_cache_dtype=kvd, max_num_seqs=8, show_progress=False)
        tok = llm.get_tokenizer()
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in PROMPTS]
        runs[kvd] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        plan = llm.llm_engine.core.resolved.kv
        capacity[kvd] = (plan.num_usable_tokens, plan.kv_dtype)
        print(f"{kvd:>9}: {time.perf_counter() - t0:.1f} s, KV as {plan.kv_dtype}: {plan.num_usable_tokens} tokens",
              flush=True)
        del llm
    base = runs["auto"]
    print(f"\ngreedy {args.max_tokens} tokens, {len(PROMPTS)} prompts, model dtype {args.dtype}; "
          "tokens equal before the first divergence from kv_cache_dtype=auto:")
    for kvd in args.kv_cache_dtypes:
        agree = [agreement(a, b) for a, b in zip(runs[kvd], base)]
        full = sum(n == args.max_tokens for n in agree)
        print(f"  {kvd:>9}: {agree}  mean {sum(agree) / len(agree):.1f}, {full}/{len(agree)} in full, "
              f"KV tokens {capacity[kvd][0]} = {capacity[kvd][0] / capacity['auto'][0]:.2f}x auto's")
    return 0


if __name__ == "__main__":
    sys.exit(main())

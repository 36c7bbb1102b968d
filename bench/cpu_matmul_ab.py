"""Two ``--cpu-matmul`` modes in one process, alternated: batch-1 decode and one prompt's prefill.

    python bench/cpu_matmul_ab.py                                   # the built-in model: native vs native-int16
    python bench/cpu_matmul_ab.py --arms native native-int8 --rounds 8 --tokens 256 --prefill 1024

These VMs' speed drifts by a third within minutes, more than a kernel change moves a step, so
process-by-process comparisons (``jaxllm bench latency`` on each mode in turn) need many
rounds to say anything.  Here both engines live in one process (each its own compiled
programs; one runs at a time) and every round runs each arm once, the order reversed every
other round (ABBA), so a drift lands on both.  Per round and arm:

* decode: one request of ``--tokens`` new tokens after a 32-token prompt (temperature 0, EOS
  ignored), less a one-token request of the same prompt, per token: ms per token, prefill
  excluded (``bench/llama_cpp.py``'s method);
* prefill: one ``--prefill``-token prompt (random ids, prefix caching off) and one new token:
  prompt tokens per second.

Printed: the medians over rounds per arm, and each arm's ratio to the first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from jaxllm import LLM, SamplingParams


def _timed(llm: LLM, ids: list[int], n: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    return time.perf_counter() - t0


def measure(engines: dict[str, LLM], rounds: int, tokens: int, prefill: int, vocab: int,
            seed: int = 0) -> dict[str, dict[str, list[float]]]:
    """arm -> {"decode_ms": [per round], "prefill_tps": [per round]}; one warm-up round first."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, vocab, 32).tolist()
    out = {name: {"decode_ms": [], "prefill_tps": []} for name in engines}
    names = list(engines)
    for r in range(rounds + 1):
        long_prompt = rng.integers(1, vocab, prefill).tolist()   # a new prompt each round
        for name in (names if r % 2 else names[::-1]):
            llm = engines[name]
            decode = (_timed(llm, prompt, tokens) - _timed(llm, prompt, 1)) / (tokens - 1)
            tps = prefill / _timed(llm, long_prompt, 1)
            if r:   # round 0 warms the programs and caches up
                out[name]["decode_ms"].append(decode * 1e3)
                out[name]["prefill_tps"].append(tps)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint (default: the built-in model)")
    p.add_argument("--arms", nargs="+", default=["native", "native-int16"], help="--cpu-matmul values")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=128, help="new tokens of the decode request")
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill request")
    args = p.parse_args(argv)
    if args.tokens < 2:
        p.error("--tokens must be at least 2 (a one-token request is subtracted)")
    if len(set(args.arms)) != len(args.arms) or len(args.arms) < 2:
        p.error("--arms takes two or more distinct --cpu-matmul values")
    engines = {arm: LLM(args.model, cpu_matmul=arm, enable_prefix_caching=False, max_num_seqs=1,
                        max_model_len=max(args.prefill, 32 + args.tokens) + 16, precompile="on-demand",
                        skip_tokenizer_init=True)   # token ids in, token ids out
               for arm in args.arms}
    first = engines[args.arms[0]]
    kernels = {arm: llm.llm_engine.core.runner.cfg.kernels.linear for arm, llm in engines.items()}
    vocab = first.llm_engine.core.runner.cfg.arch.vocab_size
    res = measure(engines, args.rounds, args.tokens, args.prefill, vocab)
    print(f"{args.rounds} rounds, arms alternated (ABBA); decode: {args.tokens} tokens after 32, prefill: "
          f"{args.prefill} tokens; medians")
    print("| --cpu-matmul | linear maps | decode ms/token | decode vs first | prefill tok/s | prefill vs first |")
    print("|---|---|---:|---:|---:|---:|")
    base = {k: statistics.median(v) for k, v in res[args.arms[0]].items()}
    for arm in args.arms:
        med = {k: statistics.median(v) for k, v in res[arm].items()}
        print(f"| {arm} | {kernels[arm]} | {med['decode_ms']:.2f} | {base['decode_ms'] / med['decode_ms']:.2f}x | "
              f"{med['prefill_tps']:.1f} | {med['prefill_tps'] / base['prefill_tps']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

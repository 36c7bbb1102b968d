"""LoRA throughput of the built-in model: output tokens/s with 0, 1 and N distinct adapters.

    python bench/lora.py [--batch-sizes 1,32] [--adapters 1,8] [--output-len 32] [--repeats 5]
    python bench/lora.py --programs 1,32      # what one step program costs to compile, no timing run
    python bench/lora.py --lora-dtype auto,bfloat16   # a LoRA engine per slot dtype, arms of each

Two engines on the built-in model: the base (``enable_lora=False``) and one with
``enable_lora=True, max_loras=max(--adapters), max_lora_rank=16``.  The adapters are random
(``jaxllm/lora/train.py``'s ``init_lora``, B made non-zero), on every projection, ranks 8 and
16 alternating, saved as peft saves them.  Arms, each a whole greedy ``generate`` of exactly
``--output-len`` tokens per prompt (bench/harness.py's ``measure``: they take turns call by
call, so a drift of the shared machine moves every arm alike):

* ``base``: the engine without LoRA;
* ``lora engine, 0 adapters``: the LoRA engine, no request names an adapter (the cost of the
  LoRA path alone: the slot inputs and, per projection, a call of cpu/lora.cc that finds no
  token with a slot (on the native matmul; on XLA a loop of no iteration or a cond not taken),
  lora/apply.py);
* ``K adapters``: request ``i`` runs adapter ``i % K``.

With several ``--lora-dtype`` values (``--lora-dtype``: the slots' dtype, "auto" = the model's)
each has its own LoRA engine and its arms are named with it: ``1 adapter (bfloat16)``.

``--programs T,...``: instead, for the base engine and the LoRA engine (one sequence, ``max_loras``
8), each one-sequence step program of ``T`` tokens is lowered and compiled once, and printed:
the process CPU seconds of the compile (less inflated by a shared machine than its wall
time), the kernels XLA made of it (fusions, dots, loops, conditionals, dynamic slices,
copies) and its ``bytes accessed`` (XLA's cost analysis: a loop's body counted once).

Printed: the median output tokens/s of each arm and its ratio to ``base``, with the load
average when the batch size finished (the machine may be shared).  The issue's targets:
8 adapters at batch 32 >= 0.8x base, 1 adapter at batch 1 >= 0.85x.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
import time

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)          # python bench/lora.py from anywhere

from bench.harness import LLMTimer, measure, token_prompts  # noqa: E402
from jaxllm import LoRARequest, SamplingParams  # noqa: E402
from jaxllm.lora.train import init_lora, save_peft  # noqa: E402

RANKS = (8, 16)


def random_adapters(arch, n: int, folder: str) -> list[str]:
    """``n`` adapters on every projection with non-zero A and B, saved as peft saves them."""
    paths = []
    for i in range(n):
        r = RANKS[i % len(RANKS)]
        lora = init_lora(arch, rank=r, alpha=2 * r, key=jax.random.key(i))
        rng = np.random.default_rng(i)
        weights = {p: {"A": ab["A"], "B": rng.normal(0, 0.02, ab["B"].shape).astype(np.float32)}
                   for p, ab in lora.weights.items()}
        paths.append(save_peft(type(lora)(weights, lora.rank, lora.alpha, lora.modules),
                               os.path.join(folder, f"adapter{i}"), "built-in"))
    return paths


class Arm:
    """One arm: an engine and the adapter each prompt runs with (``None``: the base)."""

    def __init__(self, timer: LLMTimer, loras: list):
        self.timer, self.loras = timer, loras

    def _requests(self, prompts):
        return [self.loras[i % len(self.loras)] for i in range(len(prompts))] if self.loras else None

    def warm(self, prompts):
        self.timer.llm.generate(token_prompts(prompts), self.timer.warm_params, use_tqdm=False,
                                lora_request=self._requests(prompts))

    def time(self, prompts, n=None):
        n = n or self.timer.output_len
        t0 = time.perf_counter()
        outs = self.timer.llm.generate(token_prompts(prompts), self.timer._params(n), use_tqdm=False,
                                       lora_request=self._requests(prompts))
        t = time.perf_counter() - t0
        if sorted({len(o.outputs[0].token_ids) for o in outs}) != [n]:
            raise RuntimeError(f"did not produce exactly {n} tokens per prompt")
        return t


OPS = ("fusion", "dot", "while", "conditional", "dynamic-slice", "copy", "custom-call")


def program_costs(tokens: list[int], dtype: str, lora_dtype: str = "auto") -> None:
    """``--programs``: compile each one-sequence step program of ``tokens`` once, base and LoRA."""
    kw = dict(dtype=dtype, max_num_seqs=1, max_num_batched_tokens=max(tokens), max_model_len=512, show_progress=False,
              enable_prefix_caching=False, precompile="on-demand")
    print(f"{'engine':<6} {'T':>4} {'compile CPU s':>13}  {'bytes MB':>8}  kernels")
    for name, extra in (("base", {}), ("lora", dict(enable_lora=True, max_loras=8, max_lora_rank=max(RANKS),
                                                           lora_dtype=lora_dtype))):
        r = LLMTimer(1, **kw, **extra).runner
        for T in tokens:
            lowered = r.compiler.lower_step(r.params, r.kv, r.sampler_rows.state, T, 1)
            t0 = time.process_time()
            compiled = lowered.compile()
            cpu = time.process_time() - t0
            # " while(": an opcode (an instruction's name starts with "%")
            ops = collections.Counter(re.findall(rf" ({'|'.join(OPS)})\(", compiled.as_text()))
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            print(f"{name:<6} {T:>4} {cpu:>13.1f}  {cost.get('bytes accessed', 0) / 1e6:>8.1f}  "
                  + " ".join(f"{op} {ops[op]}" for op in OPS if ops[op]), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--adapters", default="1,8", help="numbers of distinct adapters, comma separated")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--programs", default=None, help="token counts: print each step program's compile cost instead")
    ap.add_argument("--lora-dtype", default="auto",
                    help="the adapter slots' dtype (auto, float16, bfloat16, float32); several, comma separated: "
                         "a LoRA engine each")
    args = ap.parse_args(argv)
    if args.programs:
        tokens = [int(t) for t in args.programs.split(",")]
        if not tokens or min(tokens) < 1:
            raise ValueError("--programs must be positive integers")
        return program_costs(tokens, args.dtype, args.lora_dtype.split(",")[0])
    batches = [int(b) for b in args.batch_sizes.split(",")]
    counts = [int(k) for k in args.adapters.split(",")]
    if not batches or min(batches) < 1 or not counts or min(counts) < 1:
        raise ValueError("--batch-sizes and --adapters must be positive integers")

    # Prefix caching off: every repeat sends the same prompts.
    kw = dict(dtype=args.dtype, max_num_seqs=max(batches), max_num_batched_tokens=max(512, max(batches)),
              max_model_len=512, show_progress=False, enable_prefix_caching=False, precompile="all")
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    base = LLMTimer(args.output_len, warm_params=warm, **kw)
    lora_dtypes = args.lora_dtype.split(",")
    folder = tempfile.mkdtemp(prefix="jaxllm_lora_bench_")
    paths = random_adapters(base.arch, max(counts), folder)
    requests = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    arms = {"base": Arm(base, [])}
    for ld in lora_dtypes:
        lora = LLMTimer(args.output_len, warm_params=warm, enable_lora=True, max_loras=max(counts),
                        max_lora_rank=max(RANKS), lora_dtype=ld, **kw)
        tag = f" ({ld})" if len(lora_dtypes) > 1 else ""
        arms[f"lora engine, 0 adapters{tag}"] = Arm(lora, [])
        arms.update({f"{k} adapter{'s' * (k > 1)}{tag}": Arm(lora, requests[:k]) for k in counts})
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(3, 20000, size=(b, args.input_len)).tolist() for b in batches}
    print(f"built-in model, {args.dtype}, input {args.input_len}, output {args.output_len} tokens, "
          f"median of {args.repeats}; adapters: ranks {'/'.join(map(str, RANKS))} on every projection")
    print(f"{'batch':>5}  {'arm':<36} {'tok/s':>8}  {'x base':>6}  load avg")
    for b in batches:
        rates = measure(arms, {b: prompts[b]}, args.repeats, args.output_len)
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        for name in arms:
            r = rates[name][b]
            print(f"{b:>5}  {name:<36} {r:>8.1f}  {r / rates['base'][b]:>6.2f}  {load}", flush=True)


if __name__ == "__main__":
    main()

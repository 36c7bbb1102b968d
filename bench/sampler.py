"""Sampler micro-benchmark, and the sampler's share of a decode step of the built-in model.

    python bench/sampler.py                      # the table: batch 1/8/32/256 x 151,936 vocab
    python bench/sampler.py --share              # + share of a batch-32 decode step (SmolLM2)
    python bench/sampler.py --batches 1 8 --vocab 49152 --repeat 10

Every cell is the median wall time of one compiled call of ``sampler.sample`` (penalty
state included, logprobs off) on random logits, after a warm-up call.  Columns:

* greedy:            every row temperature 0 (the random path is skipped by ``lax.cond``)
* random:            temperature 1, no truncation (blocked Gumbel-argmax over the vocabulary)
* top-k/p threshold: temperature 0.8, top_k 50, top_p 0.95 with the candidate/threshold search
* top-k/p sort:      the same parameters with a full sort (``reference.sample_reference``, the
                     baseline the threshold replaces)
* flat top-p:        temperature 1, top_p 0.999 on flat logits: the nucleus overflows the
                     candidates and the bitwise threshold search runs over the whole vocabulary

``--share`` runs 32 concurrent requests on the built-in SmolLM2-135M-Instruct (float32,
49,152 vocabulary), captures the inputs of a step where all 32 rows decode, and times the
compiled step (the model: forward and logits) and the compiled sampler that follows it
on those inputs: the share is sampler / (step + sampler).  "sampler alone" is the table's
cell at batch 32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.sample.bitmask import mask_words
from jaxllm.sample import metadata as smd
from jaxllm.sample import reference as ref
from jaxllm.sample import sampler as sm

CONFIGS = {
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=1.0),
    "top-k/p threshold": dict(temperature=0.8, top_k=50, top_p=0.95),
    "top-k/p sort": dict(temperature=0.8, top_k=50, top_p=0.95),
    "flat top-p": dict(temperature=1.0, top_p=0.999),
}


def _inputs(S: int, V: int, cfg: dict, seed: int = 0, flat: bool = False):
    rng = np.random.default_rng(seed)
    scale = 0.05 if flat else 3.0
    logits = jnp.asarray((rng.standard_normal((S, V)) * scale).astype(np.float32))
    a = smd.empty_metadata(S)
    for i in range(S):
        smd.fill_row(a, i, smd.RowParams(seed=int(rng.integers(1 << 62)), **cfg), slot=i, out_pos=7,
                     num_prompt=0, reset=False, suppress=[], num_logprobs=-1)
    return logits, jax.device_put(smd.to_metadata(a)), sm.init_state(S + 1, V)


def time_sampler(S: int, V: int, cfg: dict, sort_baseline: bool = False, repeat: int = 20, flat: bool = False,
                 budget_s: float = 60.0) -> float:
    """Median seconds of one compiled sampler call (``sort_baseline``: the sort-based reference)."""
    logits, md, st = _inputs(S, V, cfg, flat=flat)
    if sort_baseline:
        f = jax.jit(lambda l, m, s: ref.sample_reference(l, m, s))
    else:
        f = jax.jit(lambda l, m, s: sm.sample(l, m, s, max_logprobs=0).token_ids)
    f(logits, md, st).block_until_ready()
    times, t_start = [], time.perf_counter()
    for _ in range(repeat):
        t0 = time.perf_counter()
        f(logits, md, st).block_until_ready()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - t_start > budget_s and len(times) >= 3:
            break
    return statistics.median(times)


def table(batches, V: int, repeat: int) -> None:
    cols = list(CONFIGS)
    print(f"sampler, vocab {V}, median ms per call ({jax.devices()[0].platform}, {jax.device_count()} device)")
    print("| batch | " + " | ".join(cols) + " |")
    print("|---:|" + "---:|" * len(cols))
    for S in batches:
        cells = []
        for name in cols:
            baseline = "sort" in name
            t = time_sampler(S, V, CONFIGS[name], sort_baseline=baseline, repeat=3 if baseline else repeat,
                             flat=name.startswith("flat"))
            cells.append(f"{t * 1e3:.2f}")
        print(f"| {S} | " + " | ".join(cells) + " |", flush=True)


def decode_share(steps: int = 12, repeat: int = 15) -> None:
    """The sampler's share of a batch-32 decode step of the built-in model: the compiled step
    (forward + logits) and the compiled sampler that follows it, timed apart on the same
    captured decode inputs."""
    from jaxllm import LLM, SamplingParams
    from jaxllm.runner import packing
    llm = LLM(max_num_seqs=32, max_num_batched_tokens=64, max_model_len=256, dtype="float32", show_progress=False,
              precompile="all")
    runner = llm.llm_engine.core.runner
    V = runner.arch.vocab_size
    run = runner._run
    captured = {}

    def capture(step):
        if step.bucket == (32, 32):
            captured.setdefault("inputs", step.inputs)
        return run(step)

    runner._run = capture
    prompts = [{"prompt_token_ids": [1 + i, 2 + i]} for i in range(32)]
    print(f"\nbuilt-in model ({llm.llm_engine.model_name}), batch-32 decode step, vocab {V}, median ms")
    print("| parameters | step (model) | sampler | sampler share | sampler alone |")
    print("|---|---:|---:|---:|---:|")
    step, sampler = runner.compiler.steps[(32, 32)], runner.compiler.samplers[32]
    rows = runner.sampler_rows
    all_allowed = np.full((32, mask_words(V)), 0xFFFFFFFF, np.uint32)   # no grammar
    for name in ("greedy", "random", "top-k/p threshold", "flat top-p"):
        cfg = CONFIGS[name]
        captured.clear()
        llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True, seed=1, **cfg), use_tqdm=False)
        words = packing.pack(captured["inputs"])
        t_step, t_sample = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            runner.kv, rows.state, logits, _, sampling_words = step(runner.params, runner.kv, rows.state, words)
            logits.block_until_ready()
            t1 = time.perf_counter()
            sampler(rows.state, logits, sampling_words, all_allowed).token_ids.block_until_ready()
            t_step.append(t1 - t0)
            t_sample.append(time.perf_counter() - t1)
        st, sa = statistics.median(t_step), statistics.median(t_sample)
        alone = time_sampler(32, V, cfg, flat=name.startswith("flat"))
        print(f"| {name} | {st * 1e3:.1f} | {sa * 1e3:.2f} | {100 * sa / (st + sa):.1f}% | {alone * 1e3:.2f} |",
              flush=True)
    runner._run = run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 256])
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--share", action="store_true", help="also measure the share of a built-in model decode step")
    p.add_argument("--no-table", action="store_true")
    args = p.parse_args(argv)
    if not args.no_table:
        table(args.batches, args.vocab, args.repeat)
    if args.share:
        decode_share()
    return 0


if __name__ == "__main__":
    sys.exit(main())

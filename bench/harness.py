"""The offline timing harness the benchmarks share: build an engine, warm it, run timed
repetitions of a generate workload, and collect what comes out (output tokens/s, step
times, compile time, an XLA trace of the measured region).

Three levels, one loop each:

* whole ``LLM.generate`` calls: :class:`LLMTimer` (one jaxllm engine) and :func:`measure`
  (any engines with ``warm``/``time``, rotating call by call): ``bench/throughput.py``,
  ``bench/compare.py`` and the end-to-end sections of ``bench/device_check.py``;
* engine steps: :func:`run_batch` with a :class:`StepLog` (``jaxllm bench throughput|latency``,
  ``bench/offline.py``), :func:`repeat` for whole measured runs;
* one compiled call: :func:`time_compiled` (the device check's kernel timings).

:class:`Profile` records an XLA trace (``jaxllm/profiling.py``) around any measured region.
"""

from __future__ import annotations

import statistics
import time


def repeat(call, n: int) -> list[float]:
    """Seconds of each of ``call(0)`` .. ``call(n - 1)``."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t0)
    return times


# ---------------------------------------------------------------------------- generate calls


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


class LLMTimer:
    """One jaxllm ``LLM``, timed call by call.

    ``time(prompts, n)`` is the seconds of one ``generate`` of exactly ``n`` tokens per prompt
    (default ``output_len``; ``ignore_eos``, at ``temperature``); it raises when the outputs are
    shorter or longer, or when any prompt token came from the prefix cache (the time would
    then leave that token's prefill out).  ``warm(prompts)`` runs ``warm_params`` on the first
    prompt (``warm_all``: on every prompt) outside any measurement.  ``llm_kw`` goes to ``LLM``;
    ``build_s`` and ``compile_s`` are the engine's start-up and the part of it spent compiling.
    """

    def __init__(self, output_len: int, *, temperature: float = 0.0, warm_params=None, warm_all: bool = False,
                 **llm_kw):
        from jaxllm import LLM, SamplingParams
        self.output_len = output_len
        self.temperature = temperature
        self.warm_params = warm_params or SamplingParams(temperature=temperature, max_tokens=2, ignore_eos=True)
        self.warm_all = warm_all
        self._params = lambda n: SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True)   # noqa: E731
        t0 = time.perf_counter()
        self.llm = LLM(**llm_kw)
        self.build_s = time.perf_counter() - t0
        self.core = self.llm.llm_engine.core
        self.runner = self.core.runner
        self.compile_s = self.runner.compiler.seconds
        self.arch = self.runner.arch

    def warm(self, prompts) -> None:
        self.llm.generate(token_prompts(prompts if self.warm_all else prompts[:1]), self.warm_params, use_tqdm=False)

    def time(self, prompts, n: int | None = None) -> float:
        n = n or self.output_len
        reqs = token_prompts(prompts)
        t0 = time.perf_counter()
        outs = self.llm.generate(reqs, self._params(n), use_tqdm=False)
        t = time.perf_counter() - t0
        lens = sorted({len(o.outputs[0].token_ids) for o in outs})
        if lens != [n]:
            raise RuntimeError(f"jaxllm did not produce exactly {n} tokens per prompt (lengths {lens})")
        cached = sum(o.num_cached_tokens or 0 for o in outs)
        if cached:
            raise RuntimeError(f"jaxllm took {cached} prompt tokens from its prefix cache: the timing would "
                               "not include their prefill")
        return t


def measure(engines: dict, prompts_by_batch: dict, repeats: int, output_len: int,
            phases: dict | None = None) -> dict:
    """Output tokens/s of every engine at every batch size: {name: {batch: median}}.

    Engines have ``warm(prompts)`` and ``time(prompts, n=None) -> seconds``.  They take turns
    call by call (one ``generate`` each, the order rotating), so a drift of a shared machine's
    speed moves every column alike and their ratios hold.  An engine with a ``batches``
    attribute runs only those batch sizes.  ``phases``: also time a one-token call right after
    each full one and fill ``phases[name][batch]`` with :func:`split_phases` of the medians.
    """
    times = {name: {} for name in engines}
    first = {name: {} for name in engines}
    for b, prompts in prompts_by_batch.items():
        names = [n for n, e in engines.items() if b in getattr(e, "batches", [b])]
        if not names:   # e.g. llama.cpp alone at a batch size it does not run
            continue
        for n in names:
            engines[n].warm(prompts)
        for r in range(repeats):
            for n in names[r % len(names):] + names[:r % len(names)]:
                times[n].setdefault(b, []).append(engines[n].time(prompts))
                if phases is not None:
                    first[n].setdefault(b, []).append(engines[n].time(prompts, 1))
    if phases is not None:
        for n, bs in first.items():
            phases[n] = {b: split_phases(statistics.median(ts), statistics.median(times[n][b]), output_len)
                         for b, ts in bs.items()}
    return {n: {b: b * output_len / statistics.median(ts) for b, ts in bs.items()} for n, bs in times.items()}


def split_phases(first_token_s: float, full_s: float, output_len: int) -> tuple[float, float]:
    """(prefill seconds, seconds per decode step) of one call: a one-token call is the
    prefill (plus one sample), the rest of a full call is ``output_len - 1`` decode steps."""
    if output_len < 2:
        raise ValueError("--phases needs --output-len of at least 2")
    return first_token_s, max(full_s - first_token_s, 0.0) / (output_len - 1)


# ---------------------------------------------------------------------------- engine steps


class StepLog:
    """Wall time and kind of every engine step run by :func:`run_batch`."""

    def __init__(self):
        self.times: list[float] = []
        self.kinds: list[str] = []   # "decode" (every scheduled request decodes) or "prefill" (any prompt work)

    def decode_times(self) -> list[float]:
        return [t for t, k in zip(self.times, self.kinds) if k == "decode"]


def _step_kind(engine) -> str:
    """The kind of the step the next ``engine.step()`` schedules."""
    sched = engine.core.scheduler
    if sched.waiting:
        return "prefill"
    return "decode" if all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running) else "prefill"


def run_batch(engine, prompts: list[list[int]], params, tag: str, log: StepLog | None = None, on_step=None):
    """Runs every prompt to completion on an ``LLMEngine`` with ``engine.step()``, timing each
    step into ``log``; returns the final ``RequestOutput``s in prompt order.  ``on_step``: an
    object whose ``begin_step()`` / ``end_step()`` are called around each step (outside the
    timed region; bench/step_breakdown.py's per-step host spans).

    Under async scheduling a call dispatches step N+1 and then waits for step N: its time is
    step N's, so it is logged with step N's kind.  The first call of a batch only dispatches
    (nothing was in flight): its time is added to the next call's entry, and the last call
    only waits.  The log then has one entry per dispatched step, as without async."""
    import jax

    from jaxllm.engine.output_processor import OutputKind
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, params, kind=OutputKind.FINAL_ONLY)
    core = engine.core
    done = {}
    n = 0
    waited_kind = None     # async: the kind of the step in flight, which the next call waits for
    carry = 0.0            # async: time of calls that only dispatched, added to the next entry
    try:
        while len(done) < len(ids) and engine.has_unfinished_requests():
            kind = _step_kind(engine)
            label = kind if not core.async_scheduling else (waited_kind or "dispatch")
            if on_step is not None and carry == 0.0:
                on_step.begin_step()
            with jax.profiler.TraceAnnotation(f"engine.step {n} ({label})"):
                t0 = time.perf_counter()
                outs = engine.step()
                dt = time.perf_counter() - t0
            if core.async_scheduling:
                waited_kind = kind if core.step_in_flight else None
            if label == "dispatch":
                carry += dt
            else:
                if on_step is not None:
                    on_step.end_step()
                if log is not None:
                    log.times.append(carry + dt)
                    log.kinds.append(label)
                carry = 0.0
            n += 1
            for o in outs:
                if o.finished:
                    done[o.request_id] = o
    except BaseException:
        engine.abort_request([i for i in ids if i not in done])
        raise
    return [done[i] for i in ids]


# ---------------------------------------------------------------------------- compiled calls


def time_compiled(call, *, warmup: int, reps: int, inner: int) -> dict:
    """Median seconds per call of a compiled function: ``reps`` samples of ``inner`` back-to-back
    calls (the last one waited for), after ``warmup`` calls."""
    import jax
    for _ in range(warmup):
        jax.block_until_ready(call())
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            r = call()
        jax.block_until_ready(r)
        samples.append((time.perf_counter() - t0) / inner)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "samples": len(samples)}


# ---------------------------------------------------------------------------- XLA trace


class Profile:
    """An XLA trace (``jaxllm/profiling.py``) around the measured region; a no-op when
    ``log_dir`` is None.  ``python``: also trace every Python call."""

    def __init__(self, log_dir: str | None, python: bool = False):
        self.log_dir = log_dir
        self.python = python
        self.trace = None
        self.summary = None

    def __enter__(self):
        if self.log_dir is not None:
            from jaxllm import profiling
            profiling.start(self.log_dir, python=self.python)
        return self

    def __exit__(self, *exc):
        if self.log_dir is None:
            return False
        from jaxllm import profiling
        self.trace = profiling.stop()
        if exc[0] is None:
            self.summary = profiling.summarize(self.trace)
        return False

    def report(self) -> None:
        """Where the trace is, how to open it, and the top XLA ops (nothing without a trace)."""
        if self.trace is None:
            return
        print()
        print(self.trace.describe())
        print()
        print(self.summary)

    def to_json(self) -> dict | None:
        return None if self.trace is None else self.trace.to_json()

"""``jaxllm bench step-breakdown``: where the wall time of one decode step goes.

    jaxllm bench step-breakdown [--model M] [--batch-size 1] [--input-len 32] [--output-len 64]
                                [--num-iters-warmup 1] [--num-iters 3] [--profile DIR] [--output-json F]
                                [engine flags]

Runs ``jaxllm bench latency``'s workload (one batch of random prompts, ``ignore_eos``,
temperature 1) under an XLA trace, and splits the mean decode step (every request decodes one
token) into:

* host phases, timed with ``perf_counter`` spans around the engine's calls (wrapped on this
  engine's objects for the run, put back after): schedule, the runner's request-state update,
  input preparation, recording the sampled tokens, the scheduler's update, output processing
  and detokenization;
* device time inside the device call (the runner's ``_run`` and ``_wait``: row writes, the
  compiled step, the sampler, the read-back), per kernel family: each native kernel by its FFI target
  (``jaxllm_linear_q4_1``, ``jaxllm_paged_attention_f32``, ``jaxllm_rms_norm_f32``, ...), the
  XLA ops of the forward, the sampler program; read from the trace inside the decode steps'
  ``engine.step N (decode)`` annotations (jaxllm/profiling.py's ``split_op_time``: each
  instant charged once, however many XLA threads run at once);
* the gaps: the device call's time when no op runs (dispatch, transfers, waits), and the rest
  of the step outside every span (the engine's own Python between the calls).

The rows sum to the measured mean step time (the last gap is what is left of it; the first
cannot be negative unless the trace charged ops of other steps, which the test guards).
Everything is measured under the profiler, so the host rows include its overhead.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass

from bench.harness import Profile, StepLog, run_batch

SAMPLER_MODULE = "jit_sample_step"
FORWARD_MODULE = "jit_step"


@dataclass(frozen=True)
class Row:
    group: str     # "host", "device" or "gap"
    name: str
    ms: float      # mean per decode step
    detail: str = ""


@dataclass(frozen=True)
class Breakdown:
    rows: tuple[Row, ...]
    step_ms: float            # mean wall time of a decode step (perf_counter around engine.step)
    median_step_ms: float
    decode_steps: int

    def total_ms(self) -> float:
        return sum(r.ms for r in self.rows)

    def group_ms(self, group: str) -> float:
        return sum(r.ms for r in self.rows if r.group == group)

    def to_json(self) -> dict:
        return {"step_ms": self.step_ms, "median_step_ms": self.median_step_ms, "decode_steps": self.decode_steps,
                "rows": [{"group": r.group, "name": r.name, "ms": r.ms, "detail": r.detail} for r in self.rows]}


# ---------------------------------------------------------------------------- host spans


class HostSpans:
    """Seconds spent in named calls, per engine step: ``wrap`` puts a timing wrapper on an
    object's attribute (put back by ``close``); ``begin_step``/``end_step`` cut the steps."""

    def __init__(self):
        self._undo: list[tuple[object, str, object, bool]] = []
        self._current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self.missing: list[str] = []

    def wrap(self, obj, attr: str, name: str) -> None:
        if obj is None or not hasattr(obj, attr):
            self.missing.append(name)
            return
        own = attr in getattr(obj, "__dict__", {})
        original = getattr(obj, attr)
        current = self._current

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                current[name] = current.get(name, 0.0) + time.perf_counter() - t0

        setattr(obj, attr, timed)
        self._undo.append((obj, attr, original, own))

    def begin_step(self) -> None:
        self._current.clear()

    def end_step(self) -> None:
        self.steps.append(dict(self._current))

    def close(self) -> None:
        for obj, attr, original, own in reversed(self._undo):
            if own:
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)   # the instance's own wrapper: the class's method shows through again
        self._undo.clear()


# Host phases: (label, where the call lives) in the order a step runs them.  A phase whose
# call is not there (the engine changed shape) is reported as missing, not an error.
HOST_PHASES = (
    ("schedule", "scheduler.schedule"),
    ("update request states", "runner.requests.update"),
    ("prepare inputs", "model_runner.prepare_sequences"),
    ("device call", "runner._run"),
    ("device call", "runner._wait"),   # the launched step's outputs read back: its device time ends here
    ("record sampled tokens", "runner.requests.record"),
    ("scheduler update", "scheduler.update_from_output"),
    ("output processing", "output_processor.process"),
    ("detokenize", "IncrementalDetokenizer.add"),
)

# A label may name several calls (their times add up): the table has one row per label.
PHASE_LABELS = tuple(dict.fromkeys(label for label, _ in HOST_PHASES))


def instrument(engine, spans: HostSpans) -> None:
    """Puts ``spans``' timers on ``engine``'s phase calls (see ``HOST_PHASES``)."""
    from jaxllm.engine import detokenizer
    from jaxllm.runner import model_runner
    core = engine.core
    runner = core.runner
    where = {
        "scheduler": core.scheduler, "runner": runner, "runner.requests": getattr(runner, "requests", None),
        "model_runner": model_runner, "output_processor": engine.output_processor,
        "IncrementalDetokenizer": detokenizer.IncrementalDetokenizer,
    }
    for label, path in HOST_PHASES:
        owner, attr = path.rsplit(".", 1)
        spans.wrap(where.get(owner), attr, label)


# ---------------------------------------------------------------------------- the table


def kernel_family(event, names: dict) -> str:
    """The row a device op is charged to: a native kernel's FFI target, else its program's part."""
    target = names.get((event.module, event.name), "").split("|")[0]
    if target.startswith("jaxllm_"):
        return target   # XLA's own custom calls (TopK, ...) count with their program
    if event.module == SAMPLER_MODULE:
        return "sampler (XLA)"
    if event.module == FORWARD_MODULE:
        return "forward: XLA ops"
    return f"other program ({event.module or '?'})"


def build(host_steps: list[dict[str, float]], step_s: list[float], device_ns: dict[str, float], busy_ns: float,
          fused_kinds: dict[str, float] | None = None) -> Breakdown:
    """The table from the decode steps' host spans and wall times (seconds, one entry per step)
    and the device time charged inside them (ns, summed over those steps)."""
    n = len(step_s)
    if n == 0:
        raise ValueError("no decode steps were measured (--output-len must be at least 2)")
    if len(host_steps) != n:
        raise ValueError(f"{len(host_steps)} host span records for {n} decode steps")
    mean = {label: 1e3 * sum(s.get(label, 0.0) for s in host_steps) / n for label in PHASE_LABELS}
    step_ms = 1e3 * sum(step_s) / n
    rows = []
    # Detokenize runs inside output processing: the latter's row is what is left of it.
    mean["output processing"] -= mean["detokenize"]
    for label in PHASE_LABELS:
        if label != "device call":
            rows.append(Row("host", label, mean[label]))
    device = {k: v / 1e6 / n for k, v in device_ns.items()}
    for k, v in sorted(device.items(), key=lambda kv: -kv[1]):
        detail = ""
        if k == "forward: XLA ops" and fused_kinds:
            top = sorted(fused_kinds.items(), key=lambda kv: -kv[1])[:3]
            detail = ", ".join(f"{name} {ns / 1e6 / n:.3f}" for name, ns in top)
        rows.append(Row("device", k, v, detail))
    busy_ms = busy_ns / 1e6 / n
    rows.append(Row("gap", "device call, no op running", mean["device call"] - busy_ms,
                    "dispatch, input/output transfers, waits"))
    accounted = sum(r.ms for r in rows)
    rows.append(Row("gap", "rest of the step", step_ms - accounted, "engine Python between the calls"))
    return Breakdown(tuple(rows), step_ms, 1e3 * statistics.median(step_s), n)


def format_table(b: Breakdown, title: str = "") -> str:
    lines = [title] if title else []
    lines.append(f"mean decode step {b.step_ms:.3f} ms (median {b.median_step_ms:.3f} ms) over {b.decode_steps} "
                 f"decode steps; rows in ms per step:")
    width = max(len(r.name) for r in b.rows)
    lines.append(f"  {'part':<7} {'':<{width}}  {'ms':>8}  {'%':>5}")
    for r in b.rows:
        pct = 100 * r.ms / b.step_ms if b.step_ms else 0.0
        lines.append(f"  {r.group:<7} {r.name:<{width}}  {r.ms:8.3f}  {pct:5.1f}  {r.detail}".rstrip())
    lines.append(f"  host {b.group_ms('host'):.3f} + device {b.group_ms('device'):.3f} + gaps {b.group_ms('gap'):.3f}"
                 f" = {b.total_ms():.3f} ms (step {b.step_ms:.3f} ms)")
    return "\n".join(lines)


def device_time(trace, decode_windows: list[tuple[float, float]]) -> tuple[dict[str, float], float, dict[str, float]]:
    """(ns per kernel family, busy ns, ns per XLA op kind of the forward) inside the windows."""
    from jaxllm import profiling
    events, _ = profiling.device_op_events(trace)
    names = profiling.kernel_names()
    charge, busy = profiling.split_op_time(events, decode_windows, lambda e: f"{e.module}\0{e.name}")
    families: dict[str, float] = {}
    fused: dict[str, float] = {}
    by_key = {f"{e.module}\0{e.name}": e for e in events}
    for k, ns in charge.items():
        fam = kernel_family(by_key[k], names)
        families[fam] = families.get(fam, 0.0) + ns
        if fam == "forward: XLA ops":
            kind = profiling.op_kind(by_key[k].name)
            fused[kind] = fused.get(kind, 0.0) + ns
    return families, busy, fused


# ---------------------------------------------------------------------------- the run


def measure(engine, batches: list[list[list[int]]], params, profile_dir: str | None,
            warmup: int = 1) -> tuple[Breakdown, object]:
    """Runs ``batches`` (the first ``warmup`` unmeasured) on an ``LLMEngine`` and returns the
    breakdown of its decode steps and the trace."""
    from jaxllm import profiling
    for i in range(warmup):
        run_batch(engine, batches[i], params, f"bd-warmup{i}")
    spans = HostSpans()
    instrument(engine, spans)
    steps = StepLog()
    own_dir = None
    if profile_dir is None:
        own_dir = tempfile.TemporaryDirectory(prefix="jaxllm-step-breakdown-")
        profile_dir = own_dir.name
    try:
        with Profile(profile_dir) as prof:
            for i, batch in enumerate(batches[warmup:]):
                run_batch(engine, batch, params, f"bd-iter{i}", steps, on_step=spans)
        spans.close()
        decode = [i for i, k in enumerate(steps.kinds) if k == "decode"]
        windows = [(s, s + d) for name, s, d in profiling.annotation_spans(prof.trace, "engine.step ")
                   if name.endswith("(decode)")]
        if len(windows) != len(decode):
            raise RuntimeError(f"the trace holds {len(windows)} decode-step annotations for {len(decode)} decode "
                               f"steps run")
        families, busy, fused = device_time(prof.trace, windows)
        b = build([spans.steps[i] for i in decode], [steps.times[i] for i in decode], families, busy, fused)
    finally:
        spans.close()
        if own_dir is not None:
            own_dir.cleanup()
    return b, prof


# ---------------------------------------------------------------------------- the command


def register(subparsers) -> None:
    from bench.offline import _add_common
    p = subparsers.add_parser(
        "step-breakdown", help="where one decode step's time goes: host phases, kernels, gaps",
        description="Splits the mean decode step of `bench latency`'s workload into host phases, device time "
                    "per kernel family (from an XLA trace) and the gaps between them.")
    d = p.add_argument_group("workload")
    d.add_argument("--batch-size", type=int, default=1, help="requests in the batch (default 1)")
    d.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (default 32)")
    d.add_argument("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    d.add_argument("--num-iters-warmup", type=int, default=1, help="unmeasured runs first (default 1)")
    d.add_argument("--num-iters", type=int, default=3, help="measured runs (default 3)")
    _add_common(p)
    p.set_defaults(func=cmd_step_breakdown)


def cmd_step_breakdown(args) -> int:
    import dataclasses

    from bench import offline
    from jaxllm.cli import engine_config_from_args
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.sampling_params import SamplingParams
    offline._positive("--batch-size", args.batch_size)
    offline._positive("--input-len", args.input_len)
    offline._positive("--num-iters-warmup", args.num_iters_warmup, allow_zero=True)
    offline._positive("--num-iters", args.num_iters)
    if args.output_len is None or args.output_len < 2:
        raise ValueError(f"--output-len must be at least 2 (a decode step follows the prefill), got {args.output_len}")
    if args.profile_python:
        raise ValueError("--profile-python: not with step-breakdown (the Python tracer would dominate the host rows)")
    offline._check_profile_dir(args.profile)
    offline._check_json_path(args.output_json)
    if args.max_num_seqs is None:
        args.max_num_seqs = args.batch_size
    elif args.max_num_seqs < args.batch_size:
        raise ValueError(f"--batch-size {args.batch_size} is larger than --max-num-seqs {args.max_num_seqs}")
    offline._check_lengths_early(args)
    config = engine_config_from_args(args)
    if config.runner.precompile == "all":
        # The warm-up runs compile the buckets this workload uses; every bucket is not needed.
        config = dataclasses.replace(config, runner=dataclasses.replace(config.runner, precompile="auto"))
    engine = LLMEngine(config)
    offline._check_lengths(engine, args.input_len, args.output_len)
    total = args.num_iters_warmup + args.num_iters
    prompts = offline.random_prompts(total * args.batch_size, args.input_len, engine.arch.vocab_size, args.seed)
    batches = [prompts[i * args.batch_size:(i + 1) * args.batch_size] for i in range(total)]
    sp = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
    b, prof = measure(engine, batches, sp, args.profile, warmup=args.num_iters_warmup)
    print(format_table(b, f"step breakdown: {engine.model_name}, batch {args.batch_size}, {args.input_len} in / "
                          f"{args.output_len} out, {args.num_iters} iterations (measured under the profiler)"))
    if args.profile is not None:
        print()
        print(prof.trace.describe())
    result = {"model": engine.model_name, "batch_size": args.batch_size, "input_len": args.input_len,
              "output_len": args.output_len, "num_iters": args.num_iters, **b.to_json(),
              "profile": prof.to_json() if args.profile is not None else None}
    offline._write_json(args.output_json, result)
    return 0

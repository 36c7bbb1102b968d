"""XLA profiles: record a trace, say where it is and how to open it, summarise the device ops.

    from jaxllm import profiling
    profiling.start("/tmp/prof")           # jax.profiler.start_trace, plus a Perfetto JSON at stop
    ...                                      # run steps
    trace = profiling.stop()                 # Trace: the run folder and its files
    print(trace.describe())                  # where the files are, how to open them
    print(profiling.format_top_ops(profiling.top_ops(trace)))

One trace at a time per process (JAX's rule); :func:`start` raises ``ProfilerError`` when one is
running, :func:`stop` when none is.  ``jaxllm bench throughput|latency --profile DIR``, the
server's ``POST /start_profile`` / ``POST /stop_profile`` (``jaxllm serve --profiler-dir DIR``)
and the quickstart notebook all go through here.

The op table reads the ``.xplane.pb`` with ``jax.profiler.ProfileData`` (part of jaxlib, so it
is always there; no TensorFlow or xprof needed) and falls back to the ``.trace.json.gz`` JAX
writes beside it.  An XLA op is an event carrying an ``hlo_op`` stat: on a GPU these sit on
the ``/device:GPU:N`` planes; on the CPU "device" XLA runs ops on its own host threads, so they
are taken from the ``/host:CPU`` plane.  Times are self times (an op that contains others, a
``while`` or a ``cond``, is charged only for what its children do not cover), summed over calls.

A native kernel runs as an XLA custom call that the trace names only ``ffi_call.N``: the table
names it by its FFI target (``jaxllm_dot16_q4_1``, ``jaxllm_paged_attention_f32``, ...), read
from the HLO text of the programs the engine registered (:func:`register_programs`; the trace
itself carries no HLO for programs compiled before it started or loaded from a cache).
"""

from __future__ import annotations

import gc
import glob
import gzip
import json
import os
import re
import threading
import weakref
from dataclasses import dataclass

import jax
from jax.profiler import ProfileData

PERFETTO_FILE = "perfetto_trace.json.gz"


class ProfilerError(RuntimeError):
    """Starting a trace while one runs, or stopping when none does."""


@dataclass(frozen=True)
class Trace:
    """What one trace wrote: ``log_dir/plugins/profile/<run>/{<host>.xplane.pb, <host>.trace.json.gz,
    perfetto_trace.json.gz}``."""

    log_dir: str
    run_dir: str
    xplane: str | None
    trace_json: str | None
    perfetto: str | None

    def files(self) -> list[str]:
        return [p for p in (self.xplane, self.trace_json, self.perfetto) if p]

    def describe(self) -> str:
        """Where the trace is and how to open it, for people."""
        lines = [f"XLA trace written to {self.run_dir}"]
        lines += [f"  {p}  ({os.path.getsize(p) / 1e6:.1f} MB)" for p in self.files()]
        lines.append("open it with one of:")
        if self.perfetto:
            lines.append("  Perfetto:    https://ui.perfetto.dev -> 'Open trace file' -> "
                         + os.path.basename(self.perfetto))
        lines.append(f"  TensorBoard: pip install tensorboard tensorboard-plugin-profile && "
                     f"tensorboard --logdir {self.log_dir}   (the Profile tab)")
        lines.append(f"  xprof:       pip install xprof && xprof --port 8791 {self.log_dir}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"log_dir": self.log_dir, "run_dir": self.run_dir, "xplane": self.xplane,
                "trace_json": self.trace_json, "perfetto": self.perfetto}


_lock = threading.Lock()
_active: dict | None = None


def start(log_dir: str, *, perfetto: bool = True, python: bool = False) -> None:
    """Starts an XLA trace that :func:`stop` writes under ``log_dir`` (created if missing).

    ``perfetto``: also write ``perfetto_trace.json.gz`` at stop (one file ui.perfetto.dev opens).
    ``python``: also record every Python function call (JAX's Python tracer): the call tree of
    the host side, at the price of ~10x more events and a much slower host while it records."""
    global _active
    log_dir = os.path.abspath(log_dir)
    if os.path.exists(log_dir) and not os.path.isdir(log_dir):
        raise ProfilerError(f"{log_dir} exists and is not a directory")
    with _lock:
        if _active is not None:
            raise ProfilerError(f"a profile is already running (started into {_active['log_dir']}); stop it first")
        os.makedirs(log_dir, exist_ok=True)
        before = set(_run_dirs(log_dir))
        try:
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 1 if python else 0
            jax.profiler.start_trace(log_dir, create_perfetto_trace=perfetto, profiler_options=options)
        except RuntimeError as e:  # a trace started elsewhere with jax.profiler directly
            raise ProfilerError(f"cannot start a profile: {e}") from None
        _active = {"log_dir": log_dir, "before": before}


def stop() -> Trace:
    """Stops the trace :func:`start` began, writes its files and returns where they are."""
    global _active
    with _lock:
        if _active is None:
            raise ProfilerError("no profile is running; start one first")
        state, _active = _active, None
        jax.profiler.stop_trace()
    log_dir = state["log_dir"]
    new = [d for d in _run_dirs(log_dir) if d not in state["before"]] or _run_dirs(log_dir)
    if not new:
        raise ProfilerError(f"the profiler wrote no trace under {log_dir}")
    return find_trace(max(new, key=os.path.getmtime), log_dir)


def _run_dirs(log_dir: str) -> list[str]:
    return [d for d in glob.glob(os.path.join(log_dir, "plugins", "profile", "*")) if os.path.isdir(d)]


def find_trace(run_dir: str, log_dir: str | None = None) -> Trace:
    """The files of one run folder (``.../plugins/profile/<run>``)."""
    def one(pattern):
        hits = sorted(glob.glob(os.path.join(run_dir, pattern)))
        return hits[0] if hits else None

    perfetto = os.path.join(run_dir, PERFETTO_FILE)
    return Trace(log_dir=log_dir or os.path.dirname(os.path.dirname(os.path.dirname(run_dir))), run_dir=run_dir,
                 xplane=one("*.xplane.pb"), trace_json=one("*.trace.json.gz"),
                 perfetto=perfetto if os.path.isfile(perfetto) else None)


def latest_trace(log_dir: str) -> Trace:
    """The newest run under ``log_dir`` (for traces taken with ``jax.profiler`` directly)."""
    runs = _run_dirs(os.path.abspath(log_dir))
    if not runs:
        raise ProfilerError(f"no trace under {log_dir} (expected {log_dir}/plugins/profile/<run>/)")
    return find_trace(max(runs, key=os.path.getmtime), os.path.abspath(log_dir))


# ---------------------------------------------------------------------------- kernel names

# compiled programs (jax.stages.Compiled) -> the number of the registration that brought them
_programs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_registrations = 0
_targets_of: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # program -> its parsed targets
_CUSTOM_CALL = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*custom_call_target="([^"]+)"', re.M)
_MODULE = re.compile(r"^HloModule ([\w.\-]+)", re.M)


def register_programs(programs) -> None:
    """Remembers compiled programs (weakly) so that the op table can name their custom calls."""
    global _registrations
    _registrations += 1
    for p in programs:
        _programs[p] = _registrations


def custom_call_targets(hlo_text: str) -> dict[tuple[str, str], str]:
    """(HLO module, instruction) -> custom-call target of one program's HLO text."""
    m = _MODULE.search(hlo_text)
    module = m.group(1) if m else ""
    return {(module, op): target for op, target in _CUSTOM_CALL.findall(hlo_text)}


def kernel_names(programs=None) -> dict[tuple[str, str], str]:
    """(HLO module, instruction) -> custom-call target over ``programs`` (default: the registered
    ones).  Programs of one module name (the step's buckets) may number their instructions
    differently: where they disagree the targets are joined with ``|``.  Of the registered
    programs, an instruction is named by the latest registration that has it (the engine built
    last, the one a benchmark profiles; an earlier engine of the process, another model's, numbers
    its calls its own way)."""
    found: dict[tuple[str, str], set[str]] = {}
    latest: dict[tuple[str, str], int] = {}
    if programs is None:
        gc.collect()   # an engine let go of but not yet collected must not lend its names
    for p in list(_programs if programs is None else programs):
        targets = _targets_of.get(p) if programs is None else None
        if targets is None:
            try:
                targets = custom_call_targets(p.as_text() or "")
            except Exception:  # noqa: BLE001 - a program without HLO text: no names, not a failure
                targets = {}
            if programs is None:
                _targets_of[p] = targets
        registration = _programs.get(p, 0) if programs is None else 0
        for key, target in targets.items():
            if registration > latest.get(key, -1):
                latest[key] = registration
                found[key] = set()
            if registration == latest[key]:
                found[key].add(target)
    return {key: "|".join(sorted(ts)) for key, ts in found.items()}


# ---------------------------------------------------------------------------- reading it back


@dataclass(frozen=True)
class OpEvent:
    """One execution of one XLA op."""

    name: str         # the HLO instruction, e.g. "fusion.12", "while.87", "ffi_call.3"
    module: str       # the HLO module, e.g. "jit_step"
    plane: str        # "/host:CPU", "/device:GPU:0", ...
    thread: str
    start_ns: float
    duration_ns: float
    program: str = ""  # the compiled program's id: one module name (jit_step) has one program per bucket


@dataclass(frozen=True)
class OpStat:
    name: str
    module: str
    """The HLO module; ``jit_step#2`` when several compiled programs of one module name ran
    (the engine compiles the step once per bucket, and op names are only unique within one)."""
    count: int
    self_ns: float
    total_ns: float
    target: str = ""
    """A custom call's target (the native kernel, e.g. ``jaxllm_dot16_q4_1``) when known."""

    @property
    def kind(self) -> str:
        """The op without XLA's numeric suffix (``fusion.12`` -> ``fusion``); a custom call's
        target when known."""
        return self.target or op_kind(self.name)

    @property
    def label(self) -> str:
        """What the table shows: ``jaxllm_dot16_q4_1 (ffi_call.426)``, else the HLO name."""
        return f"{self.target} ({self.name})" if self.target else self.name


def op_kind(name: str) -> str:
    return re.sub(r"(\.\d+)+(\.clone)?$|\.clone$", "", name)


def device_op_events(trace: Trace | str) -> tuple[list[OpEvent], str]:
    """Every XLA op event of the trace, and which file they came from.

    Accepts a :class:`Trace` or a path to an ``.xplane.pb`` / ``.trace.json.gz``.  Raises
    ``ProfilerError`` (saying why) when neither file can be read."""
    if isinstance(trace, str):
        path = trace
        trace = Trace(log_dir="", run_dir=os.path.dirname(path),
                      xplane=path if path.endswith(".xplane.pb") else None,
                      trace_json=path if path.endswith(".json.gz") else None, perfetto=None)
    errors = []
    if trace.xplane:
        try:
            return _events_from_xplane(trace.xplane), trace.xplane
        except Exception as e:  # noqa: BLE001 - a jaxlib without ProfileData, a truncated file
            errors.append(f"{os.path.basename(trace.xplane)}: {type(e).__name__}: {e}")
    if trace.trace_json:
        try:
            return _events_from_trace_json(trace.trace_json), trace.trace_json
        except Exception as e:  # noqa: BLE001
            errors.append(f"{os.path.basename(trace.trace_json)}: {type(e).__name__}: {e}")
    if not errors:
        errors.append(f"no .xplane.pb or .trace.json.gz in {trace.run_dir}")
    raise ProfilerError("cannot read the trace: " + "; ".join(errors))


def _prefer_device(events: list[OpEvent]) -> list[OpEvent]:
    """Device-plane ops when there are any, else the host's (the CPU backend).  Where a device
    plane has xprof's derived "XLA Ops" line, only that line: its stream lines hold the same ops
    again as kernels.  (Not checked on a GPU here: no device was available.)"""
    on_device = [e for e in events if e.plane.startswith("/device:")]
    if not on_device:
        return events
    derived = {e.plane for e in on_device if e.thread == "XLA Ops"}
    return [e for e in on_device if e.plane not in derived or e.thread == "XLA Ops"]


def _events_from_xplane(path: str) -> list[OpEvent]:
    data = ProfileData.from_file(path)
    out = []
    for plane in data.planes:
        for line in plane.lines:
            for e in line.events:
                stats = dict(e.stats)
                op = stats.get("hlo_op")
                if op is None:
                    continue
                out.append(OpEvent(name=str(op), module=str(stats.get("hlo_module", "")), plane=plane.name,
                                   thread=line.name, start_ns=float(e.start_ns), duration_ns=float(e.duration_ns),
                                   program=str(stats.get("program_id", ""))))
    return _prefer_device(out)


def _events_from_trace_json(path: str) -> list[OpEvent]:
    with gzip.open(path, "rb") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    procs, threads = {}, {}
    for ev in events:
        if ev.get("ph") == "M" and ev.get("name") == "process_name":
            procs[ev.get("pid")] = ev.get("args", {}).get("name", "")
        elif ev.get("ph") == "M" and ev.get("name") == "thread_name":
            threads[(ev.get("pid"), ev.get("tid"))] = ev.get("args", {}).get("name", "")
    out = []
    for ev in events:
        args = ev.get("args") or {}
        if ev.get("ph") != "X" or "hlo_op" not in args:
            continue
        pid, tid = ev.get("pid"), ev.get("tid")
        out.append(OpEvent(name=str(args["hlo_op"]), module=str(args.get("hlo_module", "")),
                           plane=procs.get(pid, str(pid)), thread=threads.get((pid, tid), str(tid)),
                           start_ns=float(ev["ts"]) * 1e3, duration_ns=float(ev.get("dur", 0)) * 1e3))
    return _prefer_device(out)


def _self_times(events: list[OpEvent]) -> list[float]:
    """Each event's duration minus what the events nested inside it on the same thread cover."""
    selfs = [e.duration_ns for e in events]
    by_thread: dict[tuple[str, str], list[int]] = {}
    for i, e in enumerate(events):
        by_thread.setdefault((e.plane, e.thread), []).append(i)
    for idx in by_thread.values():
        idx.sort(key=lambda i: (events[i].start_ns, -events[i].duration_ns))
        stack: list[int] = []
        for i in idx:
            e = events[i]
            while stack and events[stack[-1]].start_ns + events[stack[-1]].duration_ns <= e.start_ns:
                stack.pop()
            if stack:
                selfs[stack[-1]] -= e.duration_ns
            stack.append(i)
    return [max(s, 0.0) for s in selfs]


def top_ops(trace: Trace | str | list[OpEvent], n: int | None = None,
            names: dict[tuple[str, str], str] | None = None) -> list[OpStat]:
    """XLA ops by total self time, largest first (all of them when ``n`` is None).  ``names``:
    (HLO module, instruction) -> custom-call target, default :func:`kernel_names`."""
    events = trace if isinstance(trace, list) else device_op_events(trace)[0]
    if names is None:
        names = kernel_names()
    acc: dict[tuple[str, str, str], list[float]] = {}
    for e, s in zip(events, _self_times(events)):
        a = acc.setdefault((e.module, e.program, e.name), [0, 0.0, 0.0])
        a[0] += 1
        a[1] += s
        a[2] += e.duration_ns
    # Programs sharing a module name are numbered by their total time, largest first.
    per_program: dict[tuple[str, str], float] = {}
    for (module, program, _), (_, s, _) in acc.items():
        per_program[(module, program)] = per_program.get((module, program), 0.0) + s
    label = {}
    for module in {m for m, _ in per_program}:
        progs = sorted((p for m, p in per_program if m == module), key=lambda p: -per_program[(module, p)])
        for i, p in enumerate(progs, 1):
            label[(module, p)] = module if len(progs) == 1 else f"{module}#{i}"
    stats = [OpStat(name=name, module=label[(module, program)], count=int(c), self_ns=s, total_ns=t,
                    target=names.get((module, name), ""))
             for (module, program, name), (c, s, t) in acc.items()]
    stats.sort(key=lambda o: -o.self_ns)
    return stats if n is None else stats[:n]


def format_top_ops(stats: list[OpStat], n: int = 15, kinds: int = 8) -> str:
    """A short table of the top ``n`` ops and a one-line breakdown by op kind."""
    if not stats:
        return "no XLA op events in the trace (was anything compiled run while it recorded?)"
    total = sum(o.self_ns for o in stats) or 1.0
    rows = [("self ms", "%", "calls", "avg us", "op", "module")]
    for o in stats[:n]:
        rows.append((f"{o.self_ns / 1e6:.3f}", f"{100 * o.self_ns / total:.1f}", str(o.count),
                     f"{o.self_ns / o.count / 1e3:.1f}", o.label, o.module))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"top XLA ops by self time ({len(stats)} ops, {total / 1e6:.2f} ms of op time in all):"]
    for j, r in enumerate(rows):
        cells = [c.rjust(w) if i < 4 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  " + "  ".join(cells).rstrip())
    by_kind: dict[str, float] = {}
    for o in stats:
        by_kind[o.kind] = by_kind.get(o.kind, 0.0) + o.self_ns
    top = sorted(by_kind.items(), key=lambda kv: -kv[1])[:kinds]
    lines.append("  by kind: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in top))
    numbered = sorted({o.module for o in stats if "#" in o.module})
    if numbered:
        lines.append(f"  ({', '.join(numbered)}: different compiled programs of one function, e.g. the engine's "
                     f"step buckets; #1 took the most time)")
    return "\n".join(lines)


def summarize(trace: Trace, n: int = 15) -> str:
    """``format_top_ops`` of the trace, or one line saying why the table cannot be made."""
    try:
        events, source = device_op_events(trace)
    except ProfilerError as e:
        return f"top-ops table unavailable: {e}"
    return format_top_ops(top_ops(events), n=n) + f"\n  (read from {os.path.basename(source)})"


# ---------------------------------------------------------------------------- time inside windows


def annotation_spans(trace: Trace | str, prefix: str) -> list[tuple[str, float, float]]:
    """(name, start_ns, duration_ns) of every host event whose name starts with ``prefix``
    (``jax.profiler.TraceAnnotation`` spans, e.g. bench/harness.py's ``engine.step N (decode)``),
    in start order; read from the ``.xplane.pb`` (op events and these share its clock)."""
    path = trace if isinstance(trace, str) else trace.xplane
    if not path:
        raise ProfilerError("annotation spans need the trace's .xplane.pb")
    data = ProfileData.from_file(path)
    spans = [(e.name, float(e.start_ns), float(e.duration_ns))
             for plane in data.planes for line in plane.lines for e in line.events if e.name.startswith(prefix)]
    return sorted(spans, key=lambda s: s[1])


def split_op_time(events: list[OpEvent], windows: list[tuple[float, float]], key) -> tuple[dict[str, float], float]:
    """Device time inside ``windows`` ((start_ns, end_ns), not overlapping) charged to ``key(event)``,
    and the busy time (the union of the op intervals inside the windows), both in ns.

    The CPU backend runs independent ops of one program on several threads at once, so self
    times summed over threads can exceed the wall clock.  Here each instant is charged once:
    on each thread to its innermost running op (a ``while`` only for what its body does not
    cover), and split evenly between the threads busy at that instant.  The charges therefore
    sum to the busy time exactly, and the busy time never exceeds the windows' length."""
    clipped: dict[tuple[str, str], list[tuple[float, float, str]]] = {}
    for e in events:
        s, t = e.start_ns, e.start_ns + e.duration_ns
        for ws, we in windows:
            lo, hi = max(s, ws), min(t, we)
            if hi > lo:
                clipped.setdefault((e.plane, e.thread), []).append((lo, hi, key(e)))
    # Per thread: the innermost op's segments (a stack walk over nested intervals).
    segments: list[tuple[float, float, str]] = []
    for evs in clipped.values():
        evs.sort(key=lambda x: (x[0], -x[1]))
        stack: list[tuple[float, float, str]] = []   # open intervals, innermost last
        cursor = None
        for lo, hi, k in evs + [(float("inf"), float("inf"), "")]:
            # Close every open interval that ends before this one starts, emitting what is left of it.
            while stack and (stack[-1][1] <= lo):
                top = stack.pop()
                if cursor < top[1]:
                    segments.append((cursor, top[1], top[2]))
                    cursor = top[1]
            if stack and cursor < lo:
                segments.append((cursor, lo, stack[-1][2]))
            cursor = lo
            if lo != float("inf"):
                stack.append((lo, hi, k))
    # Across threads: a sweep over the segments' ends, each instant split among the busy threads.
    points = sorted({p for s in segments for p in s[:2]})
    charge: dict[str, float] = {}
    busy = 0.0
    if not points:
        return charge, busy
    index = {p: i for i, p in enumerate(points)}
    start_at: list[list[str]] = [[] for _ in points]
    end_at: list[list[str]] = [[] for _ in points]
    for lo, hi, k in segments:
        start_at[index[lo]].append(k)
        end_at[index[hi]].append(k)
    active: dict[str, int] = {}
    for i, p in enumerate(points[:-1]):
        for k in end_at[i]:
            active[k] -= 1
        for k in start_at[i]:
            active[k] = active.get(k, 0) + 1
        n = sum(active.values())
        if n:
            dt = points[i + 1] - p
            busy += dt
            for k, c in active.items():
                if c:
                    charge[k] = charge.get(k, 0.0) + dt * c / n
    return charge, busy

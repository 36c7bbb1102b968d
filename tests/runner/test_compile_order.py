"""The compilation manager never deserializes a saved program while it compiles another:
on XLA:CPU (jaxlib 0.10.2) a load running beside a compile in the next thread crashed the
process once (a segfault inside ``deserialize_executable``)."""

from __future__ import annotations

import threading
import types
import time

from jaxllm.runner.compilation import CompilationManager


class _RecordingPrograms:
    """A program cache whose loads and compiles take a while and record when they ran."""

    root = None

    def __init__(self, cached: set[str]):
        self.cached = cached
        self.spans: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()

    def key(self, description: str) -> str:
        return description

    def has(self, key: str) -> bool:   # key: "step|T=..|S=..|<args>" or "sample|S=..|<args>"
        return "|".join(key.split("|")[:3 if key.startswith("step") else 2]) in self.cached

    def _run(self, what: str, seconds: float):
        t0 = time.perf_counter()
        time.sleep(seconds)
        with self._lock:
            self.spans.append((what, t0, time.perf_counter()))
        return type("Program", (), {})()

    def load(self, key):
        return self._run("load", 0.05)

    def compile(self, key, lower):
        return self._run("compile", 0.15)


def test_loads_never_overlap_compiles():
    mgr = CompilationManager.__new__(CompilationManager)
    mgr.steps, mgr.samplers = {}, {}
    mgr.show_progress = False
    mgr.cfg = types.SimpleNamespace(pooling_type=None)   # a generation engine: steps and samplers
    mgr._step_desc, mgr._sample_desc = "step", "sample"
    mgr.seconds, mgr.compiled, mgr.loaded = 0.0, 0, 0
    buckets = [(1, 1), (8, 4), (16, 4), (32, 8)]
    # Half of each family saved: loads and compiles interleave in job order.
    cached = {"step|T=1|S=1", "step|T=16|S=4", "sample|S=4"}
    mgr.programs = programs = _RecordingPrograms(cached)
    mgr.compile_buckets(buckets, {}, {}, {})
    assert set(mgr.steps) == set(buckets) and set(mgr.samplers) == {1, 4, 8}
    assert (mgr.loaded, mgr.compiled) == (3, 4), (mgr.loaded, mgr.compiled)
    loads = [(a, b) for what, a, b in programs.spans if what == "load"]
    compiles = [(a, b) for what, a, b in programs.spans if what == "compile"]
    overlapping = [(l, c) for l in loads for c in compiles if l[0] < c[1] and c[0] < l[1]]
    assert not overlapping, overlapping

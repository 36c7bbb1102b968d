"""bench/harness.py, the timing harness the benchmarks share: the rotation of engines call by
call, the phase split, the skipped batch sizes, and the guards of a timed jaxllm call."""

from __future__ import annotations


import pytest

from bench.harness import LLMTimer, measure, repeat, split_phases, time_compiled  # noqa: E402
from support.engines import SMALL_ENGINE  # noqa: E402


class _FixedEngine:
    """An engine that takes a fixed time per call (``first_s`` for a one-token call):
    measure()'s bookkeeping without a model.  ``log``: a list shared by several engines."""

    def __init__(self, seconds: float, batches=None, first_s: float | None = None, log=None, name=""):
        self.seconds, self.first_s, self.calls, self.warmed = seconds, first_s, [], []
        self.log, self.name = log, name
        if batches is not None:
            self.batches = batches

    def warm(self, prompts):
        self.warmed.append(len(prompts))

    def time(self, prompts, n=None):
        self.calls.append(len(prompts))
        if self.log is not None:
            self.log.append((self.name, n))
        return self.first_s if n == 1 else self.seconds


def test_measure_skips_batch_sizes_an_engine_does_not_run():
    # llama.cpp runs batch 1 only; measured alone (bench/compare.py) over batches 1 and 8 it
    # must give batch 1 and leave batch 8 out, not divide by zero rotating an empty list.
    prompts = {1: [[1, 2]], 8: [[1, 2]] * 8}
    one = _FixedEngine(0.5, batches=[1])
    assert measure({"llama.cpp": one}, prompts, repeats=3, output_len=4) == {"llama.cpp": {1: 8.0}}
    assert one.calls == [1, 1, 1] and one.warmed == [1]
    both = _FixedEngine(2.0)
    rates = measure({"llama.cpp": _FixedEngine(0.5, batches=[1]), "jaxllm": both}, prompts, repeats=3, output_len=4)
    assert rates == {"llama.cpp": {1: 8.0}, "jaxllm": {1: 2.0, 8: 16.0}}
    assert both.calls == [1, 1, 1, 8, 8, 8] and both.warmed == [1, 8]


def test_measure_rotates_the_engines_call_by_call():
    # A drift of the machine's speed must move every engine alike: each repeat starts with
    # the next engine, and with phases the one-token call follows its full call.
    log = []
    engines = {n: _FixedEngine(1.0, first_s=0.25, log=log, name=n) for n in ("a", "b", "c")}
    phases = {}
    measure(engines, {2: [[1], [2]]}, repeats=3, output_len=5, phases=phases)
    order = [n for n, k in log if k is None]
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [k for _, k in log] == [None, 1] * 9
    # The one-token call is the prefill; the other 4 tokens of the 5-token call take 0.75 s.
    assert phases == {n: {2: (0.25, pytest.approx(0.75 / 4))} for n in "abc"}


def test_split_phases():
    # A 1-token call is the prefill; the other 63 tokens of a 64-token call are decode steps.
    pre, step = split_phases(0.5, 0.5 + 63 * 0.08, 64)
    assert pre == 0.5 and step == pytest.approx(0.08)
    with pytest.raises(ValueError, match="output-len"):
        split_phases(0.5, 0.6, 1)


def test_repeat_and_time_compiled():
    seen = []
    times = repeat(seen.append, 3)
    assert seen == [0, 1, 2] and len(times) == 3 and all(t >= 0 for t in times)
    calls = []
    t = time_compiled(lambda: calls.append(1) or 0, warmup=2, reps=3, inner=4)
    assert len(calls) == 2 + 3 * 4 and t["samples"] == 3 and 0 <= t["min_s"] <= t["median_s"]


def test_a_cached_prefix_is_refused(tiny_llama):
    # The guard inside time(): with caching on, the second call finds the prompts cached, and
    # a time without their prefill is not comparable.
    timer = LLMTimer(3, model=tiny_llama, cpu_matmul="xla", **{**SMALL_ENGINE, "enable_prefix_caching": True})
    assert timer.build_s > 0 and timer.compile_s >= 0
    prompts = [[100 + i for i in range(40)]]
    assert timer.time(prompts) > 0
    with pytest.raises(RuntimeError, match="prefix cache"):
        timer.time(prompts)

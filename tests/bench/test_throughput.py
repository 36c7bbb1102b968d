"""bench/throughput.py's jaxllm side: a timed call must do the same work as the engines it
is compared with, every prompt token prefilled on every repeat."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.append(ROOT)

from bench.throughput import Jaxllm, format_phases, measure, split_phases  # noqa: E402
from conftest import SMALL_ENGINE  # noqa: E402

ENGINE = {k: v for k, v in SMALL_ENGINE.items() if k != "dtype"}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Jaxllm(argparse.Namespace(output_len=8), 2, "float32", "xla", model=tiny_llama, **ENGINE)


def test_repeated_prompts_are_prefilled_every_time(engine):
    # The bench sends the same prompts on every repeat (as transformers and llama.cpp get
    # them); a prefix-cache hit would leave their prefill out of jaxllm's time.
    prompts = [[100 + i for i in range(40)], [300 + i for i in range(37)]]   # 2+ full blocks each
    engine.warm(prompts)
    for _ in range(2):
        assert engine.time(prompts) > 0
    stats = engine.llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits == 0


def test_a_cached_prefix_is_refused(tiny_llama):
    # The guard inside time(): with caching on, the second call finds the prompts cached.
    engine = Jaxllm(argparse.Namespace(output_len=3), 2, "float32", "xla", model=tiny_llama,
                    enable_prefix_caching=True, **ENGINE)
    prompts = [[100 + i for i in range(40)]]
    engine.time(prompts)
    with pytest.raises(RuntimeError, match="prefix cache"):
        engine.time(prompts)


def test_split_phases():
    # A 1-token call is the prefill; the other 63 tokens of a 64-token call are decode steps.
    pre, step = split_phases(0.5, 0.5 + 63 * 0.08, 64)
    assert pre == 0.5 and step == pytest.approx(0.08)
    with pytest.raises(ValueError, match="output-len"):
        split_phases(0.5, 0.6, 1)


def test_phases_time_a_one_token_call_beside_each_full_one(engine):
    args = argparse.Namespace(output_len=8, repeats=2)
    prompts = {2: [[100 + i for i in range(40)], [300 + i for i in range(37)]]}
    phases = {}
    rates = measure({"jaxllm": engine}, args, prompts, phases)
    pre, step = phases["jaxllm"][2]
    assert pre > 0 and step > 0
    # The full call (its median, from the tok/s) is the prefill plus 7 decode steps.
    assert 2 * 8 / rates["jaxllm"][2] == pytest.approx(pre + 7 * step, rel=1e-9)
    table = format_phases(phases, [2])
    assert f"| 2 | jaxllm | {pre:.3f} | {step * 1e3:.1f} | - | - |" in table

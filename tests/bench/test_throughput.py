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

from bench.throughput import Jaxllm  # noqa: E402
from conftest import SMALL_ENGINE  # noqa: E402

ENGINE = {k: v for k, v in SMALL_ENGINE.items() if k != "dtype"}


def test_repeated_prompts_are_prefilled_every_time(tiny_llama):
    # The bench sends the same prompts on every repeat (as transformers and llama.cpp get
    # them); a prefix-cache hit would leave their prefill out of jaxllm's time.
    engine = Jaxllm(argparse.Namespace(output_len=3), 2, "float32", "xla", model=tiny_llama, **ENGINE)
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

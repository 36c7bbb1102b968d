"""bench/throughput.py's jaxllm side: a timed call must do the same work as the engines it
is compared with, every prompt token prefilled on every repeat."""

from __future__ import annotations

import argparse

import pytest

from bench.harness import measure  # noqa: E402
from bench.throughput import (Jaxllm, attention_flops, call_flops, format_bandwidth_floor,  # noqa: E402
                              format_compute_floor, format_phases, linear_flops, read_bandwidth)
from support.engines import SMALL_ENGINE  # noqa: E402

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


def test_phases_time_a_one_token_call_beside_each_full_one(engine):
    prompts = {2: [[100 + i for i in range(40)], [300 + i for i in range(37)]]}
    phases = {}
    rates = measure({"jaxllm": engine}, prompts, repeats=2, output_len=8, phases=phases)
    pre, step = phases["jaxllm"][2]
    assert pre > 0 and step > 0
    # The full call (its median, from the tok/s) is the prefill plus 7 decode steps.
    assert 2 * 8 / rates["jaxllm"][2] == pytest.approx(pre + 7 * step, rel=1e-9)
    table = format_phases(phases, [2])
    assert f"| 2 | jaxllm | {pre:.3f} | {step * 1e3:.1f} | - | - |" in table


def _counted_generate_flops(path: str, batch: int, input_len: int, output_len: int) -> dict:
    """torch's FLOP counter over transformers' greedy ``generate`` of the same call: {op: FLOPs}.
    Eager attention: its QK and PV are matmuls the counter sees (CPU sdpa is not counted)."""
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    ids = torch.arange(100, 100 + batch * input_len).reshape(batch, input_len)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len, do_sample=False,
                             pad_token_id=0)
    assert out.shape == (batch, input_len + output_len)
    return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


def test_call_flops_match_transformers_flop_counter(tiny_llama):
    # The compute floor's numerator, against an independent count: torch's FLOP counter
    # over transformers' generate on the same tiny checkpoint (GQA, untied head).
    from jaxllm.models.loader import load_model
    arch = load_model(tiny_llama).arch
    # A 7-token prompt: the weight matmuls (mm / addmm: projections, MLP, LM head).
    counted = _counted_generate_flops(tiny_llama, 2, 7, 5)
    linear = sum(n for op, n in counted.items() if op.split(".")[1] in ("mm", "addmm"))
    assert linear == linear_flops(arch, 2, 7, 5)
    # A 1-token prompt: the prefill has no masked-out keys, so transformers' attention (which
    # computes the whole square and masks it) does exactly the causal work counted here.
    counted = _counted_generate_flops(tiny_llama, 2, 1, 6)
    attn = sum(n for op, n in counted.items() if op.split(".")[1] == "bmm")
    assert attn == attention_flops(arch, 2, 1, 6)
    assert sum(counted.values()) == call_flops(arch, 2, 1, 6)


def test_compute_floor_table():
    # 10 GFLOP at 100 GFLOP/s is a 0.1 s floor; a batch-2 call of 8 tokens at 80 tok/s takes
    # 0.2 s: 50% of the floor.  An engine without that batch size prints "-".
    table = format_compute_floor({"transformers": {2: 80.0}, ("float32", "native"): {}}, lambda b: 5e9 * b,
                                 100e9, [2], output_len=8)
    assert "100 GFLOP/s" in table
    assert "| 2 | 10.0 | 50% | - |" in table


def test_read_stream_reads_every_byte():
    # 64 MiB, twice the L3 here.  The program checks every repeat's sum of the buffer; a loop
    # the compiler dropped (a first draft printed 10,940 GB/s) fails that check, and so does
    # a thread that skips its slice.
    rate, why = read_bandwidth(64 * 2**20, repeats=3)
    if rate is None and why.startswith("no C compiler"):
        pytest.skip(why)
    assert rate is not None, why
    assert 1e8 < rate < 1e12


def test_read_stream_reports_a_failed_build(monkeypatch):
    monkeypatch.setenv("CC", "false")
    rate, why = read_bandwidth(2**20, repeats=1)
    assert rate is None and why.startswith("building read_stream.c failed")


def test_bandwidth_floor_lines():
    # 100 MB a step over 40 GB/s copy: a 400 tok/s floor; 300 tok/s is 75% of it, and all of
    # the 300 tok/s a 30 GB/s read-only stream allows.
    text = format_bandwidth_floor([("jaxllm bfloat16 native", 300.0, 100e6)], 40e9, 30e9)
    assert "read-only stream 30.0 GB/s = 75% of the copy bandwidth 40.0 GB/s" in text
    assert "jaxllm bfloat16 native: 100 MB per step, floor 400.0 tok/s, measured 300.0 tok/s = 75% of the floor, " \
           "100% of the read ceiling" in text
    text = format_bandwidth_floor([("llama.cpp f16", 200.0, 100e6)], 40e9, None, "no C compiler (set CC)")
    assert "read ceiling: not measured, no C compiler (set CC)" in text
    assert "= 50% of the floor" in text and "read ceiling," not in text

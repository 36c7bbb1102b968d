"""bench/host_dispatch.py: its two arms run one engine both ways (the flat step call, and the
compiled objects' own call with ``jax.device_get``), produce the same tokens, and leave the
runner as it was."""

from __future__ import annotations

from bench.host_dispatch import arm, measure
from jaxllm.parallel import mesh as pmesh
from jaxllm.runner.flat_call import FlatProgram


def test_arms_generate_the_same_tokens_and_restore_the_runner(tiny_llm):
    program = tiny_llm.llm_engine.core.runner.compiler.steps[(1, 1)]
    to_host = pmesh.to_host
    with arm("compiled"):
        assert not program.fast and pmesh.to_host is not to_host
    assert program.fast and pmesh.to_host is to_host
    results = measure(tiny_llm, rounds=2, tokens=6, prompt="one two three")   # raises if the arms' tokens differ
    assert {name: len(rows) for name, rows in results.items()} == {"compiled": 2, "flat": 2}
    assert all(wall > 0 and cpu > 0 for rows in results.values() for wall, cpu in rows)
    assert isinstance(FlatProgram.fast, property)

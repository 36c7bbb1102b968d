"""The KV cache is updated in place: the compiled step holds no copy of a cache buffer.

A copy of the cache per layer or per step is invisible in outputs and ruinous for speed
(it made a decode step scale with the pool size), so it is checked in the optimized HLO.
"""

from __future__ import annotations

import re

import jax
import pytest

from jaxllm.models.loader import load_model
from jaxllm.runner.model_runner import ModelRunner


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scan"])
@pytest.mark.parametrize("max_model_len", [32, 256])
def test_step_hlo_has_no_cache_copies(tiny_llama, scan_layers, max_model_len):
    model = load_model(tiny_llama)
    runner = ModelRunner(model, dtype="float32", scan_layers=scan_layers, num_blocks=61, block_size=16,
                         max_model_len=max_model_len, max_num_seqs=4, max_num_batched_tokens=8, max_logprobs=2,
                         show_progress=False)
    a = model.arch
    layer_shape = f"61,16,{a.num_kv_heads},{a.head_dim}"
    shape = f"f32[{a.num_layers},{layer_shape}]" if scan_layers else f"f32[{layer_shape}]"
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    for T, S in runner.buckets:
        hlo = jax.jit(runner._step_fn, donate_argnums=(1, 2)).lower(
            jax.tree.map(spec, runner.params), jax.tree.map(spec, runner.kv), jax.tree.map(spec, runner.sstate),
            runner._input_spec(T, S)).compile().as_text()
        copies = [ln for ln in hlo.splitlines()
                  if re.search(r"= " + re.escape(shape) + r"\{[0-9,]*\} copy\(", ln)]
        assert not copies, f"bucket {(T, S)} copies the KV cache:\n" + "\n".join(copies[:3])
        assert "input_output_alias" in hlo, "the KV cache is not donated"

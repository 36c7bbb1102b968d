"""The compiled step does its per-step work once: the KV cache is updated in place (no copy
of a cache buffer) and RoPE's cos/sin are evaluated once, not once per layer.

Both are invisible in outputs and ruinous or wasteful for speed (a cache copy made a
decode step scale with the pool size; per-layer cos/sin cost ~4 ms of a batch-32 CPU
step), so they are checked in the optimized HLO of every bucket.
"""

from __future__ import annotations

import re

import jax
import pytest

from jaxllm.models.loader import load_model
from jaxllm.runner.model_runner import ModelRunner
from jaxllm.runner.step_config import StepConfig

# The unrolled layers with the shortest context (one page run of 32 positions) and the
# stacked cache through lax.scan with the longest (256): the two ends, not the full
# product; the unrolled layers at 256 are also compiled below (quantized caches), and the
# native attention's steps in tests/kernels/test_cpu_attention.py::test_step_hlo_has_no_cache_copies.
CONFIGS = [(False, 32), (True, 256)]
# Two rows and four tokens: three buckets, a decode-shaped (1, 1) and (2, 2) and a prefill-
# shaped (4, 2) with more tokens than rows (each bucket is a program of its own to compile).
ROWS = dict(max_num_seqs=2, max_num_batched_tokens=4)
IDS = [f"{'scan' if scan else 'unrolled'}-{mml}" for scan, mml in CONFIGS]


@pytest.fixture(scope="module")
def step_hlos(tiny_llama):
    """(scan_layers, max_model_len) -> (runner, {bucket: optimized HLO text of its step})."""
    model = load_model(tiny_llama)
    out = {}
    for scan_layers, max_model_len in CONFIGS:
        cfg = StepConfig(arch=model.arch, platform=jax.default_backend(), dtype="float32", scan_layers=scan_layers,
                         max_model_len=max_model_len, **ROWS, max_logprobs=2)
        runner = ModelRunner(model, cfg, num_blocks=61, show_progress=False)
        out[(scan_layers, max_model_len)] = runner, {
            (T, S): runner.compiler.lower_step(runner.params, runner.kv, runner.sampler_rows.state, T, S)
            .compile().as_text()
            for T, S in runner.buckets}
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_step_hlo_has_no_cache_copies(step_hlos, config):
    runner, hlos = step_hlos[config]
    a = runner.arch
    layer_shape = f"61,16,{a.num_kv_heads},{a.head_dim}"
    shape = f"f32[{a.num_layers},{layer_shape}]" if runner.cfg.scan_layers else f"f32[{layer_shape}]"
    for bucket, hlo in hlos.items():
        copies = [ln for ln in hlo.splitlines()
                  if re.search(r"= " + re.escape(shape) + r"\{[0-9,]*\} copy\(", ln)]
        assert not copies, f"bucket {bucket} copies the KV cache:\n" + "\n".join(copies[:3])
        assert "input_output_alias" in hlo, "the KV cache is not donated"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the guard (layers/rotary.cos_sin) is CPU-only")
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_rope_cos_sin_evaluated_once_per_step(step_hlos, config):
    # XLA:CPU fuses cos(positions * inv_freq) into each layer's q and k rotation (2 per
    # layer) unless cos_sin keeps it in its own computation: at most one cosine per branch
    # of its conditional, whatever the depth.
    runner, hlos = step_hlos[config]
    assert runner.arch.num_layers >= 2
    for bucket, hlo in hlos.items():
        n = hlo.count(" cosine(")
        assert n <= 2, f"bucket {bucket}: cos evaluated in {n} places (once per layer's rope?)"


# Each format with each attention backend, the layer layout rotated over the four: every
# format and every backend meets both layouts.
@pytest.mark.parametrize("scan_layers,kv_cache_dtype,attention", [
    (True, "int8", "xla"), (False, "int8", "native"), (False, "fp8_e4m3", "xla"), (True, "fp8_e4m3", "native"),
], ids=["scan-int8-xla", "unrolled-int8-native", "unrolled-fp8_e4m3-xla", "scan-fp8_e4m3-native"])
def test_quantized_cache_is_updated_in_place(tiny_llama, kv_cache_dtype, scan_layers, attention):
    """A quantized cache (values, and int8's float16 scales) is written in place too: no copy
    of any of its buffers, and no convert of a whole one (XLA:CPU turned an fp8 scatter into
    a convert of the whole cache to f16 and back: hence fp8 stored as uint8 bits on CPU)."""
    from jaxllm.cpu import native
    from jaxllm.models.kernels import Kernels
    if attention == "native" and not native.available():
        pytest.skip("native CPU kernel unavailable here (no AVX2/FMA or no C++ compiler)")
    model = load_model(tiny_llama)
    cfg = StepConfig(arch=model.arch, platform=jax.default_backend(), dtype="float32", scan_layers=scan_layers,
                     max_model_len=256, **ROWS, max_logprobs=2,
                     kernels=Kernels(attention=attention), kv_cache_dtype=kv_cache_dtype)
    runner = ModelRunner(model, cfg, num_blocks=61, show_progress=False)
    a = runner.arch
    lead = f"{a.num_layers},61" if scan_layers else "61"
    # The cache's buffers by shape, whatever their dtype: values, and int8's scales.
    whole = [f"[{lead},16,{a.num_kv_heads},{a.head_dim}]"] + (
        [f"[{lead},16,{a.num_kv_heads},1]"] if kv_cache_dtype == "int8" else [])
    T, S = runner.buckets[-1]
    hlo = runner.compiler.lower_step(runner.params, runner.kv, runner.sampler_rows.state, T, S).compile().as_text()
    assert ("s8" if kv_cache_dtype == "int8" else "u8") + whole[0] in hlo
    for shape in whole:
        copies = [ln for ln in hlo.splitlines() if re.search(r"= \w+" + re.escape(shape) + r"\{[0-9,]*\} copy\(", ln)]
        assert not copies, "the step copies the quantized KV cache:\n" + "\n".join(copies[:3])
    converts = [ln for ln in hlo.splitlines() if " convert(" in ln and any(w + "{" in ln for w in whole)]
    assert not converts, "a whole cache buffer is converted:\n" + "\n".join(converts[:3])

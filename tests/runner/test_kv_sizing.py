"""The KV cache the runner actually allocates stays within the budget (read back from the
device arrays, for a model with several layers and GQA), and ``--gpu-memory-utilization``
on CPU sizes it from the memory available to the process.  No step is compiled here."""

from __future__ import annotations

import dataclasses
import re

import pytest

from jaxllm.config import EngineConfig, parse_size
from jaxllm.core import kv_budget
from jaxllm.engine import resolve as engine_resolve
from jaxllm.engine.resolve import resolve_config
from jaxllm.models.loader import load_model
from jaxllm.runner.model_runner import ModelRunner


@pytest.fixture(scope="module")
def model(tiny_llama):
    m = load_model(tiny_llama)
    assert m.arch.num_layers > 1 and m.arch.num_kv_heads < m.arch.num_heads, "precondition: layers and GQA"
    return m


def allocated(model, cfg, scan_layers):
    r = resolve_config(cfg, model)
    step = dataclasses.replace(r.step, scan_layers=scan_layers, max_logprobs=2)
    runner = ModelRunner(model, step, num_blocks=r.kv.num_blocks, show_progress=False)
    return r, runner.kv_cache_bytes()


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scan"])
@pytest.mark.parametrize("budget", [1 << 20, 3 * (1 << 20) + 12345])
def test_allocated_kv_bytes_stay_within_the_budget(model, scan_layers, budget):
    cfg = EngineConfig.from_kwargs(kv_cache_memory_bytes=budget, max_model_len=256, dtype="float32")
    r, nbytes = allocated(model, cfg, scan_layers)
    assert nbytes == r.kv.total_bytes
    assert nbytes <= budget
    assert budget - nbytes < r.kv.bytes_per_block          # and the budget is used, not wasted


KV_DTYPES = ["auto", "int8", "fp8", "fp8_e5m2"]


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scan"])
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_kv_bytes_stay_within_the_budget_and_hold_more_tokens(model, scan_layers, kv_cache_dtype, dtype):
    budget = 3 * (1 << 20) + 12345
    cfg = EngineConfig.from_kwargs(kv_cache_memory_bytes=budget, max_model_len=256, dtype=dtype,
                                   kv_cache_dtype=kv_cache_dtype)
    r, nbytes = allocated(model, cfg, scan_layers)
    # Every array of the cache (values and int8's scales) read back from the device.
    assert nbytes == r.kv.total_bytes and nbytes <= budget
    assert budget - nbytes < r.kv.bytes_per_block
    # The tokens against a cache in the model dtype for the same budget: the exact ratio of
    # the bytes of a token (K and V of one layer), counted here from the architecture.
    a = model.arch
    model_token = 2 * a.num_kv_heads * a.head_dim * (4 if dtype == "float32" else 2)
    token = {"auto": model_token, "int8": 2 * a.num_kv_heads * (a.head_dim + 2)}.get(
        kv_cache_dtype, 2 * a.num_kv_heads * a.head_dim)
    assert r.kv.bytes_per_block == a.num_layers * r.kv.block_size * token
    base = resolve_config(dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, kv_cache_dtype="auto")),
                          model).kv
    assert r.kv.num_blocks == budget // (a.num_layers * r.kv.block_size * token)
    ratio = r.kv.num_usable_tokens / base.num_usable_tokens
    assert ratio == pytest.approx(model_token / token, rel=0.02)
    line = r.kv.describe(256)
    if kv_cache_dtype == "auto":
        assert f"{r.kv.num_usable_tokens} tokens as {dtype}, " in line and "the tokens of" not in line
    else:
        name = "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype
        assert (f"{r.kv.num_usable_tokens} tokens as {name} ({model_token / token:.2f}x the tokens of {dtype} "
                f"in the same bytes), ") in line


def test_smollm2_shape_holds_at_least_1_9x_the_tokens_of_bf16():
    # The built-in model's KV shape (30 layers, 3 KV heads of 64): int8 with its float16
    # scales 128 / 66 = 1.94x the tokens of bf16, fp8 exactly 2x, 3.88x and 4x float32's.
    from jaxllm.layers import kv_quant
    plan = lambda kvd, isz: kv_budget.plan_kv_cache(  # noqa: E731
        num_layers=30, token_bytes=kv_quant.token_bytes(3, 64, isz, kvd), block_size=16, max_model_len=2048,
        max_num_seqs=4, budget_bytes=512 * 2**20, num_blocks_override=None).num_usable_tokens
    bf16, f32 = plan("auto", 2), plan("auto", 4)
    assert plan("int8", 2) / bf16 == pytest.approx(128 / 66, rel=1e-3) and plan("int8", 2) / bf16 >= 1.9
    assert plan("fp8", 2) / bf16 == pytest.approx(2.0, rel=1e-3)
    assert plan("int8", 4) / f32 == pytest.approx(256 / 66, rel=3e-3)    # whole blocks, one reserved


def test_quantized_kv_cache_is_refused_under_tensor_parallelism(model):
    cfg = EngineConfig.from_kwargs(kv_cache_dtype="int8", tensor_parallel_size=2, max_model_len=256)
    with pytest.raises(ValueError, match="--kv-cache-dtype int8 runs on one device; with --tensor-parallel-size 2"):
        resolve_config(cfg, model)


def test_gpu_memory_utilization_on_cpu_is_a_fraction_of_available_memory(model, monkeypatch):
    monkeypatch.setattr(engine_resolve, "available_memory_bytes", lambda: 100 * 2**20)
    cfg = EngineConfig.from_kwargs(gpu_memory_utilization=0.05, max_model_len=256, dtype="float32")
    r, nbytes = allocated(model, cfg, scan_layers=False)
    budget = int(0.05 * 100 * 2**20)
    assert r.kv.budget_bytes == budget
    # Measured memory is noisy: the count is rounded down coarsely (kv_budget.coarse_blocks).
    assert r.kv.num_blocks == kv_budget.coarse_blocks(budget // r.kv.bytes_per_block)
    assert nbytes <= budget
    # An explicit byte budget wins over the fraction.
    cfg = EngineConfig.from_kwargs(gpu_memory_utilization=0.05, kv_cache_memory_bytes=1 << 20, max_model_len=256,
                                   dtype="float32")
    assert resolve_config(cfg, model).kv.budget_bytes == 1 << 20
    # Too small a fraction is refused, naming the flag and what would fit.
    cfg = EngineConfig.from_kwargs(gpu_memory_utilization=0.0005, max_model_len=256, dtype="float32")
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization=0.0005 .* fewer than one sequence .*"
                                         r"--max-model-len \d+ or less"):
        resolve_config(cfg, model)


def test_flag_validation():
    for kwargs, needle in ((dict(gpu_memory_utilization=0), "--gpu-memory-utilization"),
                           (dict(gpu_memory_utilization=1.5), "--gpu-memory-utilization"),
                           (dict(scheduling_policy="sjf"), "--scheduling-policy"),
                           (dict(enable_prefix_caching="yes"), "--enable-prefix-caching"),
                           (dict(kv_cache_dtype="int4"), "--kv-cache-dtype must be one of auto, fp8"),
                           (dict(kv_cache_dtype="float16"), "--kv-cache-dtype")):
        with pytest.raises(ValueError, match=needle):
            EngineConfig.from_kwargs(**kwargs)
    cfg = EngineConfig.from_kwargs(enable_prefix_caching=False, scheduling_policy="lpm")
    assert cfg.cache.enable_prefix_caching is False and cfg.scheduler.scheduling_policy == "lpm"
    assert EngineConfig().cache.enable_prefix_caching is True       # on by default, as in vLLM


def test_cli_flags_reach_the_config():
    from jaxllm.cli import build_parser, engine_config_from_args
    args = build_parser().parse_args(["generate", "hi", "--no-enable-prefix-caching", "--scheduling-policy",
                                      "priority", "--gpu-memory-utilization", "0.5"])
    cfg = engine_config_from_args(args)
    assert cfg.cache.enable_prefix_caching is False and cfg.cache.gpu_memory_utilization == 0.5
    assert cfg.scheduler.scheduling_policy == "priority"
    cfg = engine_config_from_args(build_parser().parse_args(["generate", "hi", "--enable-prefix-caching"]))
    assert cfg.cache.enable_prefix_caching is True and cfg.scheduler.scheduling_policy == "fcfs"
    assert cfg.cache.kv_cache_dtype == "auto"
    for value in ("int8", "fp8", "fp8_e4m3", "fp8_e5m2"):
        cfg = engine_config_from_args(build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", value]))
        assert cfg.cache.kv_cache_dtype == value
    with pytest.raises(SystemExit):         # argparse: "argument --kv-cache-dtype: invalid choice"
        build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "int4"])


def test_vllm_num_gpu_blocks_override_is_accepted(tiny_llama):
    from jaxllm import LLM
    llm = LLM(tiny_llama, num_gpu_blocks_override=40, max_model_len=256, max_num_seqs=2,
              max_num_batched_tokens=16, precompile="on-demand", show_progress=False)
    assert llm.llm_engine.core.runner.num_blocks == 40              # allocated: 40 per layer
    assert llm.llm_engine.get_stats().num_blocks == 39              # one is the null block
    cfg = EngineConfig.from_kwargs(num_gpu_blocks_override=40)
    assert cfg.cache.num_blocks_override == 40
    with pytest.raises(ValueError, match="num_gpu_blocks_override and num_blocks_override"):
        EngineConfig.from_kwargs(num_gpu_blocks_override=40, num_blocks_override=50)
    with pytest.raises(ValueError, match="--num-gpu-blocks-override must be a positive integer"):
        EngineConfig.from_kwargs(num_gpu_blocks_override=0)


def test_too_small_a_budget_says_what_it_needs_in_mib_and_a_valid_value(model):
    cfg = EngineConfig.from_kwargs(kv_cache_memory_bytes=1000, max_model_len=256, dtype="float32")
    with pytest.raises(ValueError) as e:
        resolve_config(cfg, model)
    msg = str(e.value)
    assert "or less" not in msg, msg          # no "--max-model-len 0 or less": 0 is refused
    assert re.search(r"needs at least [\d.]+ (KiB|MiB|GiB)", msg), msg
    m = re.search(r"use --kv-cache-memory-bytes (\S+) or more", msg)
    assert m, msg
    # The suggestion is itself accepted, as the flag reads it.
    ok = EngineConfig.from_kwargs(kv_cache_memory_bytes=parse_size(m.group(1), "--kv-cache-memory-bytes"),
                                  max_model_len=256, dtype="float32")
    assert resolve_config(ok, model).kv.num_blocks >= 256 // ok.cache.block_size

"""The KV cache the runner actually allocates stays within the budget (read back from the
device arrays, for a model with several layers and GQA), and ``--gpu-memory-utilization``
on CPU sizes it from the memory available to the process.  No step is compiled here."""

from __future__ import annotations

import dataclasses

import pytest

from jaxllm.config import EngineConfig
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
                           (dict(enable_prefix_caching="yes"), "--enable-prefix-caching")):
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

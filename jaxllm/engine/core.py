"""EngineCore: the step loop's body.  scheduler -> runner -> scheduler, once per ``step()``.

It also resolves the configuration against the checkpoint and the platform (dtype,
max_model_len, KV blocks, buckets) and warms the runner up, so that once it exists
serving never compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
from dataclasses import dataclass

import jax

from jaxllm.config import EngineConfig, default_cache_dir, platform_defaults
from jaxllm.core.kv_budget import KVPlan, available_memory_bytes, plan_kv_cache, utilization_budget
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.scheduler import Scheduler
from jaxllm.models.loader import LoadedModel
from jaxllm.outputs import EngineCoreOutput
from jaxllm.parallel import distributed
from jaxllm.parallel.mesh import replica_devices
from jaxllm.request import Request
from jaxllm.runner import compile as cc
from jaxllm.runner.model_runner import ModelRunner

log = logging.getLogger("jaxllm.engine")


@dataclass(frozen=True)
class ResolvedConfig:
    """The numbers the engine actually runs with."""

    dtype: str
    attention_backend: str
    sampler_backend: str
    scan_layers: bool
    matmul_backend: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv: KVPlan
    """(On an accelerator with --gpu-memory-utilization, a function of the budget until the
    engine core has measured the device.)"""
    compile_cache_dir: str


def _attention_backend(asked: str, platform: str, dtype: str, tp: int, scan: bool) -> str:
    """``--attention-backend`` resolved: auto is pallas on a GPU; on CPU the native kernel
    when it builds, on one device (an opaque custom call does not shard) with unrolled
    layers (the measured CPU default; a stacked cache works but is not auto-picked) and a
    float32 or bfloat16 cache; xla otherwise.  An explicit "native" that cannot run is refused."""
    on_gpu = platform in ("gpu", "cuda", "rocm")
    if asked == "auto":
        if on_gpu:
            return "pallas"
        if platform == "cpu" and tp == 1 and not scan and dtype in ("float32", "bfloat16"):
            from jaxllm.cpu import native
            if native.available():
                return "native"
        return "xla"
    if asked == "native":
        if platform != "cpu":
            raise ValueError(f"--attention-backend native is a CPU kernel; on {platform} use --attention-backend "
                             "pallas or xla (auto picks)")
        if tp > 1:
            raise ValueError("--attention-backend native does not shard; with --tensor-parallel-size > 1 use "
                             "--attention-backend xla (auto picks it)")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--attention-backend native takes a float32 or bfloat16 KV cache, not --dtype {dtype}; "
                             "use --attention-backend xla")
        from jaxllm.cpu import native
        if not native.available():
            raise ValueError("--attention-backend native: the native CPU kernel is unavailable on this machine "
                             "(see the warning above); use --attention-backend xla")
    return asked


def resolve_config(config: EngineConfig, model: LoadedModel) -> ResolvedConfig:
    platform = jax.default_backend()
    defaults = platform_defaults(platform)
    rc, sc, cache = config.runner, config.scheduler, config.cache
    dtype = defaults["dtype"] if rc.dtype == "auto" else rc.dtype
    on_gpu = platform in ("gpu", "cuda", "rocm")
    tp = config.parallel.tensor_parallel_size
    scan = defaults["scan_layers"] if rc.scan_layers is None else rc.scan_layers
    backend = _attention_backend(rc.attention_backend, platform, dtype, tp, scan)
    sampler = rc.sampler_backend
    if sampler == "auto":
        sampler = "pallas" if on_gpu and not rc.use_fp64_gumbel else "xla"
    if sampler == "pallas" and rc.use_fp64_gumbel:
        raise ValueError("--use-fp64-gumbel needs --sampler-backend xla (the Pallas reduction draws "
                         "float32 noise)")
    if platform == "cpu" and dtype == "bfloat16" and "pallas" in (backend, sampler):
        raise ValueError("--attention-backend/--sampler-backend pallas on CPU runs the kernels in interpret "
                         "mode, which does not take the CPU's packed bfloat16 cache; use --dtype float32")
    if tp > 1 and backend == "pallas" and model.arch.num_kv_heads % tp:
        raise ValueError(f"--attention-backend pallas with --tensor-parallel-size {tp} needs the KV heads "
                         f"({model.arch.num_kv_heads}) to split evenly; use --attention-backend xla")
    matmul = "xla"
    if tp > 1 and rc.cpu_matmul == "native":
        # The native kernel is an opaque custom call: XLA's partitioner would gather every
        # weight onto each device to run it.
        raise ValueError("--cpu-matmul native does not shard; with --tensor-parallel-size > 1 use "
                         "--cpu-matmul xla (auto picks it)")
    if platform == "cpu" and rc.cpu_matmul != "xla" and tp == 1:
        from jaxllm.cpu import native
        if native.available():
            matmul = "native"
        elif rc.cpu_matmul == "native":
            raise ValueError("--cpu-matmul native: the native CPU kernel is unavailable on this machine "
                             "(see the warning above); use --cpu-matmul xla")
    model_len = model.arch.max_position_embeddings
    max_model_len = sc.max_model_len or model_len
    if max_model_len > model_len:
        raise ValueError(f"--max-model-len {max_model_len} is longer than the model's context "
                         f"length ({model_len})")
    max_num_seqs = sc.max_num_seqs or defaults["max_num_seqs"]
    max_tokens = sc.max_num_batched_tokens or max(defaults["max_num_batched_tokens"], max_num_seqs)
    if max_tokens < max_num_seqs:
        raise ValueError(f"--max-num-batched-tokens ({max_tokens}) must be at least --max-num-seqs ({max_num_seqs})")
    a = model.arch
    import numpy as np
    itemsize = np.dtype(jax.numpy.dtype(dtype)).itemsize
    plan = functools.partial(
        plan_kv_cache, num_layers=a.num_layers, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
        itemsize=itemsize, block_size=cache.block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        num_blocks_override=cache.num_blocks_override, platform=platform)
    util = cache.gpu_memory_utilization
    if util is not None and cache.kv_cache_memory_bytes is None and cache.num_blocks_override is None:
        if platform == "cpu":
            free = available_memory_bytes()
            budget = utilization_budget(util, free)
            kv = plan(budget_bytes=budget, measured=True, budget_flag=(
                f"--gpu-memory-utilization={util} ({budget} bytes of the {free} available)"))
        else:
            # Sized by EngineCore once the weights are on the device and the step's
            # activations are known (see size_kv_from_device).
            kv = plan
    else:
        kv = plan(budget_bytes=cache.kv_cache_memory_bytes)
    cache_dir = rc.compile_cache_dir or f"{default_cache_dir()}/xla"
    return ResolvedConfig(dtype=dtype, attention_backend=backend, sampler_backend=sampler, scan_layers=scan, matmul_backend=matmul,
                          max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens, kv=kv,
                          compile_cache_dir=cache_dir)


class EngineCore:
    def __init__(self, config: EngineConfig, model: LoadedModel, replica: int = 0):
        """``replica``: which data-parallel replica this is (it runs on that slice of the devices)."""
        self.config = config
        pc = config.parallel
        devices = replica_devices(pc.tensor_parallel_size, pc.data_parallel_size, replica)
        self.resolved = r = resolve_config(config, model)
        cc.enable_persistent_cache(r.compile_cache_dir)
        cc.install_listeners()
        deferred = not isinstance(r.kv, KVPlan)
        self.runner = ModelRunner(
            model, dtype=r.dtype, scan_layers=r.scan_layers, matmul_backend=r.matmul_backend,
            attention_backend=r.attention_backend, sampler_backend=r.sampler_backend,
            num_blocks=None if deferred else r.kv.num_blocks,
            block_size=config.cache.block_size, max_model_len=r.max_model_len, max_num_seqs=r.max_num_seqs,
            max_num_batched_tokens=r.max_num_batched_tokens, max_logprobs=config.runner.max_logprobs,
            strict_compile_guard=config.runner.strict_compile_guard, show_progress=config.runner.show_progress,
            logprobs_mode=config.runner.logprobs_mode, use_fp64_gumbel=config.runner.use_fp64_gumbel,
            devices=devices, expert_parallel=pc.enable_expert_parallel,
            program_dir=os.path.join(r.compile_cache_dir, "programs"))
        if deferred:
            self.resolved = r = dataclasses.replace(r, kv=self._size_kv_from_device(r.kv))
            self.runner.allocate_kv(r.kv.num_blocks)
        log.info("%s; prefix caching %s; scheduling policy %s", r.kv.describe(r.max_model_len),
                 "on" if config.cache.enable_prefix_caching else "off", config.scheduler.scheduling_policy)
        self.kv_manager = KVCacheManager(r.kv.num_blocks, r.kv.block_size,
                                         enable_prefix_caching=config.cache.enable_prefix_caching)
        sc = config.scheduler
        self.scheduler = Scheduler(self.kv_manager, max_num_seqs=r.max_num_seqs,
                                   max_num_batched_tokens=r.max_num_batched_tokens, max_model_len=r.max_model_len,
                                   policy=sc.scheduling_policy, starvation_steps=sc.starvation_steps)
        # auto: on demand for one-shot use; a server compiles the rest when it starts
        # (AsyncEngine), and every host of a multi-host engine compiles all up front.
        mode = config.runner.precompile
        self.runner.warmup(every_bucket=mode == "all" or (mode == "auto" and pc.multi_host))
        # Data-parallel replicas must not hand their unseeded requests the same seeds.
        self._seed_rng = random.Random(config.seed if replica == 0 else f"{config.seed}/replica{replica}")
        # Multi-host: host 0 schedules and publishes each step; the others follow (follow()).
        self.channel = distributed.StepChannel() if pc.multi_host else None

    @property
    def is_follower(self) -> bool:
        return self.channel is not None and not self.channel.is_leader

    def follow(self) -> None:
        """A host other than 0: runs host 0's steps until host 0 stops (shutdown or exit)."""
        if not self.is_follower:
            raise ValueError("follow() is for hosts other than host 0 (--host-index > 0)")
        while True:
            so = self.channel.receive()
            if distributed.is_stop(so):
                return
            self.runner.execute(so)

    def shutdown(self) -> None:
        """Host 0 of a multi-host engine: releases the other hosts from follow()."""
        if self.channel is not None:
            self.channel.close()

    def _size_kv_from_device(self, plan) -> KVPlan:
        """--gpu-memory-utilization on an accelerator: the weights are on the device now; the
        budget is that fraction of what the device has left, less the largest step's
        activations (as compiled)."""
        util = self.config.cache.gpu_memory_utilization
        stats = self.runner.mesh.devices.flat[0].memory_stats() or {}
        limit, in_use = stats.get("bytes_limit"), stats.get("bytes_in_use")
        if limit is None or in_use is None:
            raise ValueError("--gpu-memory-utilization: this device reports no memory statistics; "
                             "use --kv-cache-memory-bytes")
        act = self.runner.activation_bytes()
        free = limit - in_use
        budget = utilization_budget(util, free, act)
        log.info("--gpu-memory-utilization=%s: %d bytes free after the weights, %d of activations, "
                 "KV budget %d bytes", util, free, act, budget)
        return plan(budget_bytes=budget, measured=True, budget_flag=(
            f"--gpu-memory-utilization={util} ({budget} bytes: {free} free after the weights, "
            f"{act} for activations)"))

    def compile_all(self) -> None:
        """Makes every bucket's programs ready (a server calls it before taking requests)."""
        self.runner.compile_buckets(self.runner.buckets)

    def new_seed(self) -> int:
        """A 64-bit seed for an unseeded request (reproducible from ``--seed``)."""
        return self._seed_rng.getrandbits(64)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if self.is_follower:
            raise ValueError(f"host {self.channel.host} follows host 0's steps: call follow() there")
        so = self.scheduler.schedule()
        if self.channel is not None:
            self.channel.publish(so)
        if so.is_empty:
            # Still deliver finished ids so the runner drops their state.
            self.runner.execute(so)
            return []
        result = self.runner.execute(so)
        return self.scheduler.update_from_output(so, result)

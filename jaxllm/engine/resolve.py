"""The engine configuration resolved against the checkpoint and the platform, once: the
dtype, every backend (whether the native CPU kernels or the Pallas kernels can run is
decided here and nowhere else), max_model_len, the batch limits and the KV cache's size.
Configurations that cannot run are refused here with a message naming the flag."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import jax
import numpy as np

from jaxllm.config import NATIVE_MATMULS, EngineConfig, platform_defaults
from jaxllm.cpu import native
from jaxllm.core.kv_budget import (
    CacheKind,
    KVPlan,
    available_memory_bytes,
    kv_kind,
    plan_kv_cache,
    utilization_budget,
)
from jaxllm.layers import kv_quant
from jaxllm.models.kernels import Kernels
from jaxllm.models.loader import LoadedModel, gguf_file
from jaxllm.models.registry import get_family
from jaxllm.paths import default_cache_dir
from jaxllm.quant import activations
from jaxllm.quant import ops as qops
from jaxllm.runner.step_config import StepConfig

log = logging.getLogger("jaxllm.engine")


@dataclass(frozen=True)
class KVSizing:
    """What the KV cache's size depends on besides the budget (core/kv_budget.plan_kv_cache)."""

    num_layers: int
    token_bytes: int
    """One token's K and V in one layer as stored: quantized values and scales included."""
    block_size: int
    max_model_len: int
    max_num_seqs: int
    num_blocks_override: int | None
    platform: str
    kv_dtype: str = ""
    """The cache's storage (the model dtype, or --kv-cache-dtype's format), for the log."""
    model_dtype: str = ""
    model_token_bytes: int = 0
    """``token_bytes`` at the model dtype: the quantized cache's gain is stated against it."""
    kinds: tuple[CacheKind, ...] = ()
    """What the cache holds per group of layers (the model family's ``cache_kinds``; K/V pages
    of every layer by default)."""

    def plan(self, budget_bytes: int | None, measured: bool = False, budget_flag: str | None = None) -> KVPlan:
        plan = plan_kv_cache(kinds=self.kinds or (kv_kind(self.num_layers, self.token_bytes),),
                             block_size=self.block_size,
                             max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                             budget_bytes=budget_bytes, num_blocks_override=self.num_blocks_override,
                             budget_flag=budget_flag, platform=self.platform, measured=measured)
        gain = self.model_token_bytes / self.token_bytes if self.kv_dtype != self.model_dtype else None
        return dataclasses.replace(plan, kv_dtype=self.kv_dtype, model_dtype=self.model_dtype, token_gain=gain)


@dataclass(frozen=True)
class ResolvedConfig:
    """The numbers the engine actually runs with."""

    step: StepConfig
    kv: KVPlan | None
    """None on an accelerator with --gpu-memory-utilization: the engine core sizes the cache
    (``kv_sizing``) once the weights are on the device and the step's activations are known."""
    kv_sizing: KVSizing
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
        if not native.available():
            raise ValueError("--attention-backend native: the native CPU kernel is unavailable on this machine "
                             "(see the warning above); use --attention-backend xla")
    return asked


def _check_quantization(config: EngineConfig, model: LoadedModel) -> bool:
    """Whether the weights are quantized; refuses a ``--quantization`` the checkpoint is not
    (an HF folder's is checked against its config.json by the loader)."""
    is_gguf = gguf_file(config.model) is not None
    if config.quantization == "gguf" and not is_gguf:
        raise ValueError(f"--quantization gguf: {config.model} is not a GGUF file")
    if config.quantization not in (None, "gguf") and is_gguf:
        raise ValueError(f"--quantization {config.quantization} is for HF checkpoints; "
                         f"{config.model or 'the built-in model'} is a GGUF file (its blocks are served as they are)")
    return any(qops.is_quantized(w) for w in model.tensors())


def _cache_kinds(arch, itemsize: int, kv_name: str) -> tuple[CacheKind, ...]:
    """The model family's cache kinds (``Family.cache_kinds(arch, itemsize, kv_cache_dtype)``:
    MLA's latent pages, a hybrid model's recurrent state), else K/V pages in every layer."""
    kinds = get_family(arch.architecture).cache_kinds
    if kinds is not None:
        return tuple(kinds(arch, itemsize, kv_name))
    return (kv_kind(arch.num_layers, kv_quant.token_bytes(arch.num_kv_heads, arch.head_dim, itemsize, kv_name)),)


def _draft_kinds(draft: LoadedModel | None, itemsize: int, kv_name: str) -> tuple[CacheKind, ...]:
    """A draft model's cache, in the target's budget: its runner allocates as many blocks as
    the target's (it only holds sequences the target holds), so each of its layers counts in
    every block like one of the target's (as vLLM sizes the draft's layers with the target's)."""
    if draft is None:
        return ()
    return tuple(dataclasses.replace(k, name=f"draft {k.name}") for k in _cache_kinds(draft.arch, itemsize, kv_name))


def resolve_config(config: EngineConfig, model: LoadedModel, draft: LoadedModel | None = None) -> ResolvedConfig:
    """``draft``: the draft model of ``method: draft_model``; its cache shares the budget."""
    if get_family(model.arch.architecture).pooling:   # an encoder has no forward to generate with
        raise ValueError(f"{model.arch.architecture} is an encoder: it embeds or scores rather than generates; "
                         "use the pooling runner (LLM(model, runner='pooling'), jaxllm serve --runner pooling)")
    platform = jax.default_backend()
    defaults = platform_defaults(platform)
    rc, sc, cache = config.runner, config.scheduler, config.cache
    dtype = defaults["dtype"] if rc.dtype == "auto" else rc.dtype
    on_gpu = platform in ("gpu", "cuda", "rocm")
    tp = config.parallel.tensor_parallel_size
    scan = defaults["scan_layers"] if rc.scan_layers is None else rc.scan_layers
    quantized = _check_quantization(config, model)
    if scan and quantized and not qops.uniform_across_layers(model.layers):
        if rc.scan_layers:
            raise ValueError("--scan-layers stacks each weight over the layers, but this checkpoint quantizes "
                             "a weight differently in different layers; use --no-scan-layers")
        log.info("layers unrolled: the checkpoint quantizes a weight differently in different layers")
        scan = False
    if scan and not model.arch.uniform_layers:
        # A layer's window (and its rope) are static attributes of its attention, and a dense
        # layer has other weights than a MoE one: layers that differ cannot share one scanned body.
        if rc.scan_layers:
            raise ValueError(f"--scan-layers stacks the layers under one body, but {model.arch.architecture}'s "
                             "layers differ (sliding-window and global attention, or dense and MoE layers); "
                             "use --no-scan-layers")
        log.info("layers unrolled: %s's layers differ (attention windows or weights)", model.arch.architecture)
        scan = False
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
    if tp > 1 and cache.kv_cache_dtype != "auto":
        # The scales' sharding beside the pages is not built or tested under a mesh.
        raise ValueError(f"--kv-cache-dtype {cache.kv_cache_dtype} runs on one device; with --tensor-parallel-size "
                         f"{tp} use --kv-cache-dtype auto")
    if tp > 1 and backend == "pallas" and model.arch.num_kv_heads % tp:
        raise ValueError(f"--attention-backend pallas with --tensor-parallel-size {tp} needs the KV heads "
                         f"({model.arch.num_kv_heads}) to split evenly; use --attention-backend xla")
    # On a GPU, int8 / int4 / fp8 weights (HF quantized checkpoints) take the Pallas quantized
    # matmul (the group sizes it has; quant/ops.py falls back to XLA for the others).
    matmul = "pallas" if on_gpu and quantized else "xla"
    if tp > 1 and rc.cpu_matmul in NATIVE_MATMULS:
        # The native kernel is an opaque custom call: XLA's partitioner would gather every
        # weight onto each device to run it.
        raise ValueError("--cpu-matmul native does not shard; with --tensor-parallel-size > 1 use "
                         "--cpu-matmul xla (auto picks it)")
    if platform == "cpu" and rc.cpu_matmul != "xla" and tp == 1:
        if native.available() and (not quantized or native.quant_available()):
            matmul = "native"
        elif rc.cpu_matmul in NATIVE_MATMULS:
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
    itemsize = np.dtype(jax.numpy.dtype(dtype)).itemsize
    kv_name = kv_quant.canonical(cache.kv_cache_dtype)
    sizing = KVSizing(num_layers=a.num_layers,
                      token_bytes=kv_quant.token_bytes(a.num_kv_heads, a.head_dim, itemsize, kv_name),
                      block_size=cache.block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                      num_blocks_override=cache.num_blocks_override, platform=platform,
                      kv_dtype=dtype if kv_name == "auto" else kv_name, model_dtype=dtype,
                      model_token_bytes=kv_quant.token_bytes(a.num_kv_heads, a.head_dim, itemsize),
                      kinds=_cache_kinds(a, itemsize, kv_name) + _draft_kinds(draft, itemsize, kv_name))
    util = cache.gpu_memory_utilization
    if util is not None and cache.kv_cache_memory_bytes is None and cache.num_blocks_override is None:
        if platform == "cpu":
            free = available_memory_bytes()
            budget = utilization_budget(util, free)
            kv = sizing.plan(budget, measured=True, budget_flag=(
                f"--gpu-memory-utilization={util} ({budget} bytes of the {free} available)"))
        else:
            kv = None    # sized by EngineCore once the weights are on the device
    else:
        kv = sizing.plan(cache.kv_cache_memory_bytes)
    if kv is not None and kv.seqs_asked:
        # Per-sequence state (a recurrent layer's) for fewer sequences than asked: no more run at once.
        log.info("max_num_seqs %d clamped to %d: the KV budget holds the per-sequence state of %d sequences",
                 max_num_seqs, kv.seq_slots, kv.seq_slots)
        max_num_seqs = kv.seq_slots
    cache_dir = rc.compile_cache_dir or f"{default_cache_dir()}/xla"
    int8 = matmul == "native" and quantized and _int8_activations(rc.cpu_matmul)
    # native-int8-split is recorded on the weights (the model's layers call every linear map
    # with one backend); every other mode clears it, the model object being reusable
    for tensors in (model.globals, *model.layers):
        activations.mark(tensors, int8 and rc.cpu_matmul == "native-int8-split")
    int16 = matmul == "native" and quantized and _int16_activations(rc.cpu_matmul)
    kernels = Kernels(matmul=matmul, attention=backend, int8_activations=int8, int16_activations=int16,
                      moe="expert_parallel" if config.parallel.enable_expert_parallel else "grouped")
    step = StepConfig(arch=a, platform=platform, dtype=dtype, scan_layers=scan, kernels=kernels,
                      sampler_backend=sampler, block_size=cache.block_size,
                      max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                      max_logprobs=rc.max_logprobs, logprobs_mode=rc.logprobs_mode, use_fp64_gumbel=rc.use_fp64_gumbel,
                      kv_cache_dtype=kv_name, num_speculative_tokens=_num_speculative_tokens(config),
                      images=model.vision is not None,
                      mrope=model.vision is not None and get_family(a.architecture).mrope, pooling_type=rc.pooling_type or "",
                      **_lora_slots(config, a, dtype))
    return ResolvedConfig(step=step, kv=kv, kv_sizing=sizing, compile_cache_dir=cache_dir)


def _lora_slots(config: EngineConfig, arch, dtype: str) -> dict:
    """The step's LoRA settings: slots only with ``enable_lora``, for a family that takes
    adapters; ``--lora-dtype auto`` is the model's ``dtype``."""
    lc = config.lora
    if not lc.enable_lora:
        return {}
    if not get_family(arch.architecture).lora:
        raise ValueError(f"--enable-lora: {arch.architecture} does not take LoRA adapters here "
                         f"(the Llama-family decoders do)")
    return {"max_loras": lc.max_loras, "max_lora_rank": lc.max_lora_rank,
            "lora_dtype": dtype if lc.lora_dtype == "auto" else lc.lora_dtype}


def _int8_activations(cpu_matmul: str) -> bool:
    """Whether a GGUF's blocks meet int8-rounded activations (``cpu/quant_dot.cc``): only when
    asked for (``--cpu-matmul native-int8``, or ``native-int8-split``: quant/activations.py).
    ``auto`` keeps float32 activations: on the built-in model the int8 rounding raised the
    perplexity of a 54k-token text by more than 1% over float32 activations (``jaxllm bench
    perplexity``, docs/BENCHMARKS.md "Perplexity"), which the project's bar for a default does
    not allow, though on a CPU with AVX-512 VNNI it decodes at batch 1 about 2x faster.

    Speculative decoding stays exact with it: the native path computes a token's logits
    bit for bit alike in every step shape (its norms included, cpu/norm.cc), so a
    verification and a decode round the same activations."""
    return cpu_matmul in ("native-int8", "native-int8-split")


def _int16_activations(cpu_matmul: str) -> bool:
    """Whether a GGUF's Q4_1 blocks meet int16-rounded activations (``cpu/quant_dot.cc``'s
    ``jaxllm_dot_i16_q4_1``): with ``--cpu-matmul native-int16``, and with ``auto`` on a CPU
    without AVX-512.  There the float32 kernel widens each nibble to a float (its 8-lane walk
    and panels are bound by those vector operations), while int16 products take about half of
    them: on a Zen 3 VM batch-1 decode 1.10-1.23x and a 512-token prefill 1.01-1.14x faster
    (two engines in one process, alternated), the built-in model's perplexity equal to float32
    activations' (11.0098 against 11.0099 on the KJV Genesis) and its logits within 0.01
    (docs/BENCHMARKS.md, "int16 activations for Q4_1").  With ``auto`` also where the CPU has
    AVX-512 VNNI but not AMX (AMD Zen 4 / 5): there the Q4_1 weights are laid out in
    interleaved groups of 16 rows (runner/model_runner.py) for ``jaxllm_dot16_i16_q4_1``,
    whose vpdpwssd tiles multiply 1.4-2.3x faster than the float32 panels from 32 rows on
    (prefill) and about as fast at one row (BENCHMARKS, "int16 activations over interleaved
    rows"), and so are Q8_0 weights (the built-in model's tied LM head) for
    ``jaxllm_dot16_i16_q8_0``: on a Zen 4 the head 2.0x and batch-1 decode 1.1-1.3x faster
    (BENCHMARKS, "The LM head by int16 activations").  Elsewhere with AVX-512 the float32
    kernel's 16-lane paths stay the default: on a Xeon with AVX-512 and AMX the row-major int16
    kernels decoded 0.75x and prefilled 0.89x as fast (BENCHMARKS, "The same questions on an
    AVX-512 + AMX Xeon"; the interleaved kernel has not been measured there)."""
    return cpu_matmul == "native-int16" or (cpu_matmul == "auto" and (not native.cpu_avx512()
                                                                      or native.cpu_vnni_without_amx()))


def _num_speculative_tokens(config: EngineConfig) -> int:
    spec = config.speculative_config
    return 0 if spec is None else spec.num_speculative_tokens

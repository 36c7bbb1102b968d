"""Engine configuration: a few frozen dataclasses, each field documented and validated.

Every user-settable field is checked in ``__post_init__`` and a bad value raises a
``ValueError`` that names the CLI flag, so the CLI, the offline ``LLM`` and the server
all report the same message.  Values that depend on the checkpoint (``max_model_len``,
``dtype="auto"``) are resolved once by :func:`resolve_engine_config`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field

from jaxllm.hub import check_args as check_hub_args
from jaxllm.lora.config import LoRAConfig
from jaxllm.paths import default_cache_dir  # noqa: F401  (public here too: config.default_cache_dir)
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.structured.config import StructuredOutputsConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
CPU_MATMULS = ("auto", "native", "native-int8", "native-int8-split", "native-int16", "xla")
"""``--cpu-matmul``: native-int8 is native with a GGUF's blocks multiplied by int8-quantized
activations (``cpu/quant_dot.cc``, llama.cpp's arithmetic): faster where the CPU has AVX-512
VNNI, but more than 1% worse in perplexity on the built-in model, so auto never picks it
(docs/BENCHMARKS.md, "Perplexity").  native-int8-split runs the int8 kernel twice, on the rounded
activations and on the remainder (``quant/activations.py``).  native-int16 multiplies Q4_1 blocks
(and Q8_0 ones where the CPU has AVX-512 VNNI: the built-in model's tied LM head) by
activations rounded to int16 per 32 values (the other types as native): 1/258 of int8's
rounding, float32's perplexity, and where the CPU lacks AVX-512, or has AVX-512 VNNI without
AMX, faster than float32 activations, so auto picks it there and native (float32 activations)
elsewhere (``engine/resolve.py``)."""
NATIVE_MATMULS = tuple(m for m in CPU_MATMULS if m.startswith("native"))   # the values that ask for the native kernel
ATTENTION_BACKENDS = ("auto", "xla", "pallas", "native")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
"""``--kv-cache-dtype``: vLLM's choices (fp8 = fp8_e4m3) plus int8 (``layers/kv_quant.py``)."""
SAMPLER_BACKENDS = ("auto", "xla", "pallas")
SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
QUANTIZATION_METHODS = ("gguf", "compressed-tensors", "gptq", "fp8", "int8")
"""``--quantization`` values (vLLM's names) this engine serves: checkpoint formats (gguf,
compressed-tensors, gptq, fp8: the checkpoint must be one) and online quantization of a float
HF checkpoint at load (int8: per-channel symmetric int8; fp8: per-channel e4m3, which is also
the name of the fp8 checkpoint format)."""
PRECOMPILE_MODES = ("auto", "all", "on-demand")

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}


def parse_size(value: str | int, flag: str) -> int:
    """Parses a byte count such as ``1073741824``, ``512MiB`` or ``2GB``."""
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2) is not None and m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{flag}: cannot read {value!r} as a size (examples: 1073741824, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()])


def _positive(name: str, flag: str, value, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{flag} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing."""

    block_size: int = 16
    """Tokens per KV block (``--block-size``)."""
    kv_cache_memory_bytes: int | None = None
    """Budget in bytes for the whole KV cache across all layers (``--kv-cache-memory-bytes``).
    None: enough for ``max_num_seqs`` full-length sequences, capped at a quarter of the
    memory available to the process."""
    num_blocks_override: int | None = None
    """Exact number of blocks per layer; wins over the byte budget (``--num-gpu-blocks-override``)."""
    gpu_memory_utilization: float | None = None
    """Fraction of the memory left for the KV cache (``--gpu-memory-utilization``): on an
    accelerator, of the device memory left after the weights and the largest step's
    activations (as compiled); on CPU, of the memory available to the process (MemAvailable,
    within any cgroup limit).  Used only when ``kv_cache_memory_bytes`` is not given."""
    enable_prefix_caching: bool = True
    """Reuse the KV of cached full blocks of shared prefixes (``--enable-prefix-caching`` /
    ``--no-enable-prefix-caching``; on by default, as in vLLM)."""
    kv_cache_dtype: str = "auto"
    """Storage of the KV cache (``--kv-cache-dtype``): "auto" (the model dtype), "int8" (a
    float16 scale per token per KV head beside the values), "fp8" / "fp8_e4m3" or "fp8_e5m2"
    (scale 1.0, saturated): the same bytes hold ~2-4x the tokens (``layers/kv_quant.py``)."""
    mm_encoder_cache_tokens: int | None = None
    """A vision-language model's encoder cache budget, in encoder tokens (image rows of
    [hidden] float32; ``--mm-encoder-cache-tokens``; vLLM's ``encoder_cache_size`` counts the
    same unit): the least recently used image is evicted to fit.  None: 64 images' tokens;
    0: no cache (every image encoded each time it is scheduled)."""

    def __post_init__(self):
        m = self.mm_encoder_cache_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ValueError(f"--mm-encoder-cache-tokens must be a non-negative integer, got {m!r}")
        _positive("block_size", "--block-size", self.block_size, allow_none=False)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        _positive("kv_cache_memory_bytes", "--kv-cache-memory-bytes", self.kv_cache_memory_bytes)
        _positive("num_blocks_override", "--num-gpu-blocks-override", self.num_blocks_override)
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1):
            raise ValueError(f"--gpu-memory-utilization must be a fraction in (0, 1], got {u!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"--enable-prefix-caching must be true or false, got {self.enable_prefix_caching!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits."""

    max_num_seqs: int | None = None
    """Most requests in one step (``--max-num-seqs``). None: 32 on CPU, 256 on an accelerator."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step, prefill chunks and decodes together (``--max-num-batched-tokens``).
    None: 512 on CPU, 2048 on an accelerator."""
    max_model_len: int | None = None
    """Longest sequence, prompt plus output (``--max-model-len``). None: the checkpoint's."""
    scheduling_policy: str = "fcfs"
    """``--scheduling-policy``: fcfs (arrival order), priority (lowest ``priority`` value
    first, ties by arrival; preemption evicts the highest value) or lpm (the waiting request
    with the longest cached prefix first)."""
    starvation_steps: int = 1000
    """A request in the scheduler this many steps goes ahead of every policy's order and is
    not preempted while a younger one runs, so no request waits forever."""
    async_scheduling: bool = True
    """``--async-scheduling`` (vLLM's name; on by default, ``--no-async-scheduling`` /
    ``async_scheduling=False`` turns it off): the host schedules and prepares step N+1 while
    step N runs, N's sampled tokens feeding N+1 on the device (engine/core.py).  Outputs are
    the same token for token; steps that need the previous token on the host (structured
    outputs, ``min_tokens``, multi-token bad words) run synchronously, and speculative
    decoding and multi-host serving fall back to synchronous scheduling silently."""

    def __post_init__(self):
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        _positive("starvation_steps", "starvation_steps", self.starvation_steps, allow_none=False)
        _positive("max_num_seqs", "--max-num-seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", "--max-num-batched-tokens", self.max_num_batched_tokens)
        _positive("max_model_len", "--max-model-len", self.max_model_len)
        if (self.max_num_seqs and self.max_num_batched_tokens
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise ValueError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
                f"--max-num-seqs ({self.max_num_seqs}): every running request needs a token per step")


@dataclass(frozen=True)
class RunnerConfig:
    """How the model step is compiled and run."""

    dtype: str = "auto"
    """Weight and activation dtype (``--dtype``): auto = float32 on CPU, bfloat16 elsewhere."""
    attention_backend: str = "auto"
    """``--attention-backend``: auto (pallas on GPU; on CPU native when the kernel builds, one
    device and unrolled layers; xla otherwise), xla, pallas (on CPU the Pallas kernel runs in
    interpret mode: for tests, not speed) or native (the AVX2 CPU kernel, jaxllm/cpu/attention.cc)."""
    sampler_backend: str = "auto"
    """``--sampler-backend``: the sampler's vocabulary reduction, auto (pallas on GPU unless
    ``--use-fp64-gumbel``, xla elsewhere), xla or pallas."""
    scan_layers: bool | None = None
    """Run layers under ``lax.scan`` over stacked weights (``--scan-layers``/``--no-scan-layers``).
    None: scan on accelerators; unrolled on CPU, where XLA copies each sliced layer's
    weights before its matmuls (3x the weight traffic, measured in docs/architecture.md)."""
    cpu_matmul: str = "auto"
    """``--cpu-matmul``: auto (the native kernel when the CPU and compiler allow), native, or
    xla (XLA's dot).  Ignored on accelerators."""
    max_logprobs: int = 20
    """Most top logprobs a request may ask for (``--max-logprobs``); fixed in the compiled step."""
    logprobs_mode: str = "raw_logprobs"
    """What logprobs report (``--logprobs-mode``, vLLM's): raw_logprobs (default), raw_logits,
    processed_logprobs or processed_logits (after penalties, temperature and truncation)."""
    use_fp64_gumbel: bool = False
    """Draw with float64 Gumbel noise (53-bit uniforms) instead of float32 (``--use-fp64-gumbel``)."""
    compile_cache_dir: str | None = None
    """Persistent XLA compilation cache (``--compile-cache-dir``). None: ``$JAXLLM_CACHE_DIR/xla``
    (default ``~/.cache/jaxllm/xla``).  Saved compiled programs live in its ``programs`` folder."""
    precompile: str = "auto"
    """Which step buckets are compiled before the first step (``--precompile``): ``all``, or
    ``on-demand`` (each the first time a step needs it: a one-shot generate compiles two or
    three programs instead of every serving bucket).  ``auto``: all for a server and for a
    multi-host engine, on demand for the offline ``LLM`` and ``jaxllm generate``/``chat``."""
    strict_compile_guard: bool = False
    """Raise instead of warn when a step traces or compiles after warm-up (tests set it)."""
    show_progress: bool = True
    """Progress bar while the buckets compile."""
    pooling_type: str | None = None
    """Set by the pooling engine (``pooling/engine.py``), not a flag: "LAST" or "MEAN" makes the
    step also return each sequence's pooled final-norm hidden state, every request a pooling
    one.  None: generation."""

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if self.sampler_backend not in SAMPLER_BACKENDS:
            raise ValueError(
                f"--sampler-backend must be one of {', '.join(SAMPLER_BACKENDS)}, got {self.sampler_backend!r}")
        if self.pooling_type not in (None, "LAST", "MEAN"):
            raise ValueError(f"pooling_type must be LAST or MEAN in the generation engine's step, "
                             f"got {self.pooling_type!r}")
        if self.cpu_matmul not in CPU_MATMULS:
            raise ValueError(f"--cpu-matmul must be one of {', '.join(CPU_MATMULS)}, got {self.cpu_matmul!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"--max-logprobs must be a non-negative integer, got {self.max_logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.precompile not in PRECOMPILE_MODES:
            raise ValueError(f"--precompile must be one of {', '.join(PRECOMPILE_MODES)}, got {self.precompile!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine spreads over devices and hosts (docs/scale-out.md)."""

    tensor_parallel_size: int = 1
    """Devices one model replica is split over (``--tensor-parallel-size``, ``-tp``): attention
    heads, MLP width and the vocabulary are sharded over them (parallel/sharding.py)."""
    data_parallel_size: int = 1
    """Engine replicas behind one server (``--data-parallel-size``, ``-dp``), each on its own
    ``tensor_parallel_size`` devices; a new request goes to the least-loaded replica."""
    enable_expert_parallel: bool = False
    """Spread a mixture-of-experts model's experts over the tensor-parallel devices instead
    of splitting every expert's width (``--enable-expert-parallel``)."""
    distributed_coordinator: str | None = None
    """``host:port`` of host 0's JAX coordination service (``--distributed-coordinator``);
    set on every host of a multi-host engine (or leave it to the environment JAX reads)."""
    num_hosts: int = 1
    """Processes (hosts) that together run one engine (``--num-hosts``)."""
    host_index: int | None = None
    """This host's index in ``[0, num_hosts)`` (``--host-index``); host 0 schedules and serves HTTP."""

    def __post_init__(self):
        _positive("tensor_parallel_size", "--tensor-parallel-size", self.tensor_parallel_size, allow_none=False)
        _positive("data_parallel_size", "--data-parallel-size", self.data_parallel_size, allow_none=False)
        _positive("num_hosts", "--num-hosts", self.num_hosts, allow_none=False)
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"--enable-expert-parallel must be true or false, got {self.enable_expert_parallel!r}")
        if self.host_index is not None and (not isinstance(self.host_index, int) or isinstance(self.host_index, bool)
                                            or not 0 <= self.host_index < self.num_hosts):
            raise ValueError(f"--host-index must be an integer in [0, --num-hosts={self.num_hosts}), "
                             f"got {self.host_index!r}")
        if self.num_hosts > 1 and self.data_parallel_size > 1:
            raise ValueError("--data-parallel-size > 1 with --num-hosts > 1 is not supported: "
                             "run one multi-host engine, or data-parallel replicas on one host")
        if self.distributed_coordinator is not None:
            host, _, port = str(self.distributed_coordinator).rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--distributed-coordinator must be host:port, got {self.distributed_coordinator!r}")

    @property
    def multi_host(self) -> bool:
        return self.num_hosts > 1


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; built from CLI flags or ``LLM(...)`` keyword arguments."""

    model: str | None = None
    """Checkpoint: an HF folder, a .gguf file, a Hub repo id (``org/name``, or ``org/name:Q4_K_M``
    for one GGUF of a repo: see jaxllm/hub.py), or None for the built-in SmolLM2-135M-Instruct."""
    revision: str | None = None
    """The branch, tag or commit of a Hub model id (``--revision``); None: main."""
    download_dir: str | None = None
    """Where a Hub model id is downloaded (``--download-dir``); None: the Hugging Face cache."""
    gguf_file: str | None = None
    """The GGUF file to take from a Hub repo (``--gguf-file``), instead of a ``:QUANT`` tag."""
    tokenizer: str | None = None
    """Tokenizer when it differs from the model's (``--tokenizer``): an HF folder, a .gguf file or
    a Hub repo id (only its tokenizer files are downloaded)."""
    tokenizer_revision: str | None = None
    """The branch, tag or commit of a Hub tokenizer id (``--tokenizer-revision``); None: the
    model's ``--revision`` when the tokenizer is the model's repo or ``--tokenizer`` names one, as vLLM."""
    skip_tokenizer_init: bool = False
    """Run without a tokenizer: prompts must be token ids and outputs carry no text."""
    seed: int = 0
    """Seed for the random seeds of unseeded requests (``--seed``)."""
    quantization: str | None = None
    """How the weights are quantized (``--quantization``, vLLM's names): None takes what the
    checkpoint is (a quantized GGUF: "gguf", its blocks kept packed)."""
    dequantize: bool = False
    """Load a quantized GGUF's weights as float instead (``--dequantize``)."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    """Structured outputs (``--structured-outputs-config``, vLLM's shape; a dict or JSON text
    is parsed): the grammar backend and its engine-wide options."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (``--speculative-config``, vLLM's shape; a dict or JSON text is
    parsed); None: off."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Multi-LoRA (``enable_lora``, ``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``,
    ``--lora-dtype``): jaxllm/lora/."""
    mm_processor_kwargs: dict = field(default_factory=dict)
    """The image processor's arguments over the checkpoint's ``preprocessor_config.json``
    (``--mm-processor-kwargs '{json}'``, vLLM's flag; a dict or JSON text): for Qwen3.5,
    ``min_pixels`` and ``max_pixels`` (transformers' processor kwargs), which also bound the
    image encoder's compiled patch buckets.  Other families take none."""

    def __post_init__(self):
        object.__setattr__(self, "mm_processor_kwargs", check_mm_processor_kwargs(self.mm_processor_kwargs))
        object.__setattr__(self, "structured_outputs_config",
                           StructuredOutputsConfig.parse(self.structured_outputs_config))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        check_hub_args(self.model, self.revision, self.download_dir, self.gguf_file, self.tokenizer,
                       self.tokenizer_revision)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"--seed must be an integer, got {self.seed!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"--quantization {self.quantization!r} is not one of "
                             f"{', '.join(QUANTIZATION_METHODS)}")
        if self.dequantize and self.quantization is not None:
            raise ValueError(f"--dequantize loads float weights: it cannot be combined with "
                             f"--quantization {self.quantization}")

    @staticmethod
    def from_kwargs(**kwargs) -> "EngineConfig":
        """Builds a config from flat keyword arguments (``LLM(max_num_seqs=4, ...)``)."""
        parts = {"cache": CacheConfig, "scheduler": SchedulerConfig, "runner": RunnerConfig,
                 "parallel": ParallelConfig, "lora": LoRAConfig}
        part_kwargs: dict[str, dict] = {k: {} for k in parts}
        top: dict = {}
        top_fields = {f.name for f in dataclasses.fields(EngineConfig)} - set(parts)
        for alias, name in ENGINE_ARG_ALIASES.items():
            if alias in kwargs:
                if kwargs.get(name) is not None and kwargs[alias] is not None:
                    raise ValueError(f"{alias} and {name} are the same engine argument; give one")
                value = kwargs.pop(alias)
                kwargs[name] = value if value is not None else kwargs.get(name)
        for key, value in kwargs.items():
            if key in top_fields:
                top[key] = value
                continue
            for part, cls in parts.items():
                if key in {f.name for f in dataclasses.fields(cls)}:
                    if key == "kv_cache_memory_bytes" and value is not None:
                        value = parse_size(value, "--kv-cache-memory-bytes")
                    part_kwargs[part][key] = value
                    break
            else:
                raise ValueError(f"unknown engine argument {key!r}")
        return EngineConfig(**top, **{p: cls(**part_kwargs[p]) for p, cls in parts.items()})


ENGINE_ARG_ALIASES = {"num_gpu_blocks_override": "num_blocks_override"}
"""vLLM's spellings of engine arguments, accepted by ``LLM(...)`` for scripts ported from vLLM."""


def platform_defaults(platform: str) -> dict:
    """Defaults that differ between CPU and accelerators."""
    if platform == "cpu":
        return {"max_num_seqs": 32, "max_num_batched_tokens": 512, "dtype": "float32", "scan_layers": False}
    return {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "dtype": "bfloat16", "scan_layers": True}


GENERATION_CONFIG_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature",
                          "top_k", "top_p", "min_p", "max_new_tokens")
"""The generation_config.json keys the server reads as sampling defaults (vLLM's list)."""


DEFAULT_MM_LIMIT = 999
"""vLLM's (V1) default for a modality ``--limit-mm-per-prompt`` leaves out."""
MM_MODALITIES = ("image", "video", "audio")
"""vLLM's modality names; only images are served, the others may be set (to 0, say) as in vLLM."""


MM_PROCESSOR_KWARGS = ("min_pixels", "max_pixels")
"""The ``--mm-processor-kwargs`` keys served (Qwen3.5's image processor; transformers' spelling)."""


def check_mm_processor_kwargs(kwargs) -> dict:
    """``--mm-processor-kwargs``: a JSON object (or its text) of :data:`MM_PROCESSOR_KWARGS` ->
    positive integers, min_pixels <= max_pixels; returns it as a dict."""
    flag = "--mm-processor-kwargs (mm_processor_kwargs)"
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag}: not JSON ({e}); example: '{{\"max_pixels\": 1048576}}'") from None
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"{flag} must be a JSON object such as '{{\"max_pixels\": 1048576}}', got {kwargs!r}")
    for k, v in kwargs.items():
        if k not in MM_PROCESSOR_KWARGS:
            raise ValueError(f"{flag}: unknown key {k!r} (served: {', '.join(MM_PROCESSOR_KWARGS)})")
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{flag}: {k} must be a positive integer (pixels), got {v!r}")
    if kwargs.get("min_pixels", 0) > kwargs.get("max_pixels", float("inf")):
        raise ValueError(f"{flag}: min_pixels {kwargs['min_pixels']} > max_pixels {kwargs['max_pixels']}")
    return dict(kwargs)


def check_mm_limits(limits) -> None:
    """``--limit-mm-per-prompt``: a JSON object of modality -> non-negative integer."""
    if not isinstance(limits, dict):
        raise ValueError(f"--limit-mm-per-prompt must be a JSON object such as '{{\"image\": 4}}', got {limits!r}")
    for k, v in limits.items():
        if k not in MM_MODALITIES:
            raise ValueError(f"--limit-mm-per-prompt: unknown modality {k!r} (one of {', '.join(MM_MODALITIES)})")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"--limit-mm-per-prompt: {k!r} must be a non-negative integer, got {v!r}")


@dataclass(frozen=True)
class ServingConfig:
    """The OpenAI-compatible server (``jaxllm serve``)."""

    host: str = "127.0.0.1"
    """Address to listen on (``--host``); 0.0.0.0 listens on every interface."""
    port: int = 8000
    """TCP port (``--port``); 0 picks a free one."""
    api_key: str | None = None
    """When set, every ``/v1/*`` request needs ``Authorization: Bearer <key>`` (``--api-key``,
    or the ``JAXLLM_API_KEY`` environment variable)."""
    served_model_names: tuple[str, ...] = ()
    """Names the API accepts in ``model`` (``--served-model-name``); the first is the one
    reported.  Empty: the ``--model`` argument (or the built-in model's name)."""
    generation_config: str = "auto"
    """Sampling defaults (``--generation-config``): ``auto`` reads the checkpoint's
    generation_config.json, ``vllm`` ignores it, a folder reads that folder's file."""
    override_generation_config: dict = field(default_factory=dict)
    """Defaults merged over the ones above (``--override-generation-config '{json}'``)."""
    sse_keep_alive_interval: float = 0.0
    """Seconds of silence after which a stream carries a ``: keep-alive`` comment
    (``--sse-keep-alive-interval``); 0 turns it off."""
    chat_template: str | None = None
    """A Jinja chat template (text, or a path to a file) replacing the tokenizer's (``--chat-template``)."""
    response_role: str = "assistant"
    """Role of the generated chat message when ``add_generation_prompt`` is true (``--response-role``)."""
    graceful_timeout: float = 5.0
    """Seconds in-flight requests get to finish after SIGTERM before connections are closed."""
    profiler_dir: str | None = None
    """Enables ``POST /start_profile`` and ``POST /stop_profile`` (``--profiler-dir``): XLA traces
    (jax.profiler) are written under this folder.  None: those routes answer 404."""
    enable_auto_tool_choice: bool = False
    """``tool_choice: "auto"`` (the default when a request sends tools) is served, the model's
    tool calls parsed by ``tool_call_parser`` (``--enable-auto-tool-choice``)."""
    tool_call_parser: str | None = None
    """How tool calls are read from the output (``--tool-call-parser``: hermes, llama3_json,
    mistral, qwen3_xml, or one a plugin registers)."""
    tool_parser_plugin: str | None = None
    """A Python file that registers more tool parsers (``--tool-parser-plugin``)."""
    reasoning_parser: str | None = None
    """Splits reasoning from content (``--reasoning-parser``: deepseek_r1, qwen3)."""
    lora_modules: tuple = ()
    """LoRA adapters served from the start (``--lora-modules``; serve/lora.py's ``LoRAModule``s),
    each selected by ``"model": NAME``; the engine needs ``enable_lora``."""
    disable_log_stats: bool = False
    """No periodic stats line in the log (``--disable-log-stats``; serve/stat_logger.py)."""
    log_stats_interval: float = 10.0
    """Seconds between the periodic stats lines (vLLM's ``VLLM_LOG_STATS_INTERVAL``; here the
    environment variable ``JAXLLM_LOG_STATS_INTERVAL``)."""
    metrics_compat: str = "none"
    """Names of the ``/metrics`` series (``--metrics-compat``): ``none``, ``jaxllm:...``; ``vllm``,
    vLLM's ``vllm:...`` (what llm-d's and the Gateway API Inference Extension's router read)."""
    log_requests: bool = True
    """One access line per request: method, path, status, tokens, time (``--enable-log-requests``,
    the default, as uvicorn's access log is vLLM's; ``--disable-log-requests`` turns it off)."""
    responses_store: str = "auto"
    """Where ``/v1/responses`` keeps stored responses (``--responses-store``): ``auto`` (a sqlite
    file in the cache folder), ``none`` (nothing is stored) or a file path."""
    responses_store_max_bytes: int = 1 << 30
    """The store's size bound (``--responses-store-max-bytes``); the oldest responses are evicted
    beyond it."""
    responses_store_max_age_s: float = 30 * 24 * 3600.0
    """The store's age bound in seconds (``--responses-store-max-age``; OpenAI keeps responses 30
    days)."""
    limit_mm_per_prompt: dict = field(default_factory=dict)
    """The most items of each modality one prompt may carry (``--limit-mm-per-prompt '{"image": N}'``,
    vLLM's flag and JSON); a modality left out gets vLLM's default, :data:`DEFAULT_MM_LIMIT`."""
    allowed_local_media_path: str | None = None
    """The folder ``file://`` image URLs may read from (``--allowed-local-media-path``, vLLM's
    flag); None refuses ``file://`` URLs."""

    def __post_init__(self):
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be an integer in [0, 65535], got {self.port!r}")
        check_mm_limits(self.limit_mm_per_prompt)
        path = self.allowed_local_media_path
        if path is not None and not os.path.isdir(path):
            raise ValueError(f"--allowed-local-media-path: {path!r} is not an existing directory")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"--host must be an address, got {self.host!r}")
        if isinstance(self.log_stats_interval, bool) or not isinstance(self.log_stats_interval, (int, float)) \
                or not self.log_stats_interval > 0:
            raise ValueError(f"JAXLLM_LOG_STATS_INTERVAL must be a positive number of seconds, got "
                             f"{self.log_stats_interval!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("--api-key must be a non-empty string")
        for name in self.served_model_names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"--served-model-name: names must be non-empty strings, got {name!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError("--generation-config must be auto, vllm or a folder holding generation_config.json")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ValueError(f"--generation-config {self.generation_config!r}: not auto, vllm, or a folder")
        if not isinstance(self.override_generation_config, dict):
            raise ValueError("--override-generation-config must be a JSON object, e.g. '{\"temperature\": 0.5}'")
        for key in self.override_generation_config:
            if key not in GENERATION_CONFIG_KEYS:
                raise ValueError(f"--override-generation-config: unknown key {key!r}; the server reads "
                                 f"{', '.join(GENERATION_CONFIG_KEYS)}")
        for name, value in (("--sse-keep-alive-interval", self.sse_keep_alive_interval),
                            ("graceful_timeout", self.graceful_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if isinstance(self.responses_store_max_bytes, bool) or not isinstance(self.responses_store_max_bytes, int) \
                or self.responses_store_max_bytes < 1:
            raise ValueError(f"--responses-store-max-bytes must be a positive number of bytes, got "
                             f"{self.responses_store_max_bytes!r}")
        if isinstance(self.responses_store_max_age_s, bool) \
                or not isinstance(self.responses_store_max_age_s, (int, float)) \
                or not 0 < self.responses_store_max_age_s < float("inf"):
            raise ValueError(f"--responses-store-max-age must be a positive number of seconds, got "
                             f"{self.responses_store_max_age_s!r}")
        if self.metrics_compat not in ("none", "vllm"):
            raise ValueError(f"--metrics-compat must be none or vllm, got {self.metrics_compat!r}")
        if not isinstance(self.response_role, str) or not self.response_role:
            raise ValueError("--response-role must be a non-empty string")
        if self.profiler_dir is not None:
            if not isinstance(self.profiler_dir, str) or not self.profiler_dir:
                raise ValueError("--profiler-dir must be a folder path")
            if os.path.exists(self.profiler_dir) and not os.path.isdir(self.profiler_dir):
                raise ValueError(f"--profiler-dir {self.profiler_dir}: exists and is not a directory")

    def mm_limit(self, modality: str) -> int:
        """How many items of ``modality`` one prompt may carry."""
        return self.limit_mm_per_prompt.get(modality, DEFAULT_MM_LIMIT)

"""The static configuration of a step: everything that fixes the compiled programs besides
their arguments' shapes, resolved once by the engine (``engine/resolve.py``) and read by
the runner, the step functions and the program cache's keys.  Every backend in it is one
that can run here: the layers do not check again."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax.numpy as jnp

from jaxllm.layers import kv_quant
from jaxllm.models.config import ArchConfig
from jaxllm.models.kernels import Kernels
from jaxllm.runner import buckets as bk


@dataclass(frozen=True)
class StepConfig:
    arch: ArchConfig
    platform: str
    """JAX's default backend ("cpu", "gpu", ...)."""
    dtype: str
    """Weights, activations and KV cache ("float32", "bfloat16", "float16")."""
    scan_layers: bool
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int = 16
    kernels: Kernels = Kernels()
    """The model's matmul, attention and MoE implementations."""
    sampler_backend: str = "xla"
    """The draw's vocabulary reduction: "xla" or "pallas"."""
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    use_fp64_gumbel: bool = False
    kv_cache_dtype: str = "auto"
    """``--kv-cache-dtype``: "auto" (the cache in ``dtype``) or a quantized format
    (``layers/kv_quant.py``)."""
    num_speculative_tokens: int = 0
    """Most proposed tokens a request verifies in one step (0: no speculation); sets the
    sampling rows a step may need and the width of the sampler's per-row draft arrays."""
    max_loras: int = 0
    """LoRA adapter slots (0: LoRA off, the step takes no slot indices); ``lora/``."""
    max_lora_rank: int = 0
    """Every slot's rank (adapters are zero-padded to it)."""
    lora_dtype: str = "float32"
    """The slots' dtype (``--lora-dtype``, "auto" resolved to ``dtype``); the delta is float32."""
    images: bool = False
    """A vision-language model: the step takes image rows and each token's ``visible_upto``
    (runner/inputs.py, runner/vision.py)."""
    mrope: bool = False
    """A model with multimodal rotary positions (Qwen3.5 with images): the step takes
    ``rope_positions`` [3, T] (runner/inputs.py); other families compile nothing new."""
    pooling_type: str = ""
    """A pooling engine's step (``RunnerConfig.pooling_type``): "LAST" or "MEAN", the step also
    returns each sequence's pooled hidden state; "": generation, no extra output."""

    @property
    def packed_bf16(self) -> bool:
        """bf16 kept as uint16 bit patterns: XLA:CPU has no bf16 scatter/gather/update kernels."""
        return self.dtype == "bfloat16" and self.platform == "cpu"

    @property
    def kv_dtype(self):
        """The cache arrays' dtype, or the :class:`~jaxllm.formats.kv_pages.KVFormat` of a
        quantized cache (``runner/weights.allocate_kv_cache`` takes either)."""
        fmt = kv_quant.kv_format(self.kv_cache_dtype, self.platform)
        if fmt is not None:
            return fmt
        return jnp.uint16 if self.packed_bf16 else jnp.dtype(self.dtype)

    @property
    def expert_parallel(self) -> bool:
        return self.kernels.moe == "expert_parallel"

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @functools.cached_property
    def buckets(self) -> list[tuple[int, int]]:
        """Computed once: every step picks its bucket from it."""
        k = self.num_speculative_tokens
        return bk.step_buckets(self.max_num_batched_tokens, self.max_num_seqs,
                               self.max_num_seqs * (1 + k) if k else None, k,
                               min_tokens=bk.POOLING_MIN_TOKENS if self.pooling_type else 1)

"""The DeepSeek V2/V3 family, multi-head latent attention (``model.py``: its config reader,
parameter table, cache and forward)."""

from jaxllm.models.deepseek.model import (ARCHITECTURES, EXPERT_PARAMS, PARAMS, ROPE_TYPES, allocate_cache,
                                          arch_config, cache_kinds, compute_logits, forward, latent_width)

__all__ = ["ARCHITECTURES", "EXPERT_PARAMS", "PARAMS", "ROPE_TYPES", "allocate_cache", "arch_config", "cache_kinds",
           "compute_logits", "forward", "latent_width"]

"""The DeepSeek V2/V3 family, multi-head latent attention: ``config.py`` (its config reader),
``params.py`` (the parameter table) and ``model.py`` (the latent cache and the forward)."""

from jaxllm.models.deepseek.config import ARCHITECTURES, ROPE_TYPES, arch_config
from jaxllm.models.deepseek.model import allocate_cache, cache_kinds, compute_logits, forward, latent_width
from jaxllm.models.deepseek.params import EXPERT_PARAMS, PARAMS

__all__ = ["ARCHITECTURES", "EXPERT_PARAMS", "PARAMS", "ROPE_TYPES", "allocate_cache", "arch_config", "cache_kinds",
           "compute_logits", "forward", "latent_width"]

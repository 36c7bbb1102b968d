"""The DeepSeek V2/V3 family, multi-head latent attention: ``config.py`` (its config reader),
``params.py`` (the parameter table) and ``model.py`` (the latent cache and the forward)."""

from jaxllm.models.deepseek.config import ARCHITECTURES, ROPE_TYPES, DeepseekConfig
from jaxllm.models.deepseek.model import allocate_cache, cache_kinds, compute_logits, forward, latent_width
from jaxllm.models.deepseek.params import EXPERT_PARAMS, PARAMS

# The reader under its former name (bench/mla_bytes.py reads the published configs through it).
arch_config = DeepseekConfig.from_hf

__all__ = ["ARCHITECTURES", "DeepseekConfig", "EXPERT_PARAMS", "PARAMS", "ROPE_TYPES", "allocate_cache", "arch_config",
           "cache_kinds",
           "compute_logits", "forward", "latent_width"]

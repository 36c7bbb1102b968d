"""The hybrid family: Qwen3-Next and Qwen3.5, Gated DeltaNet and gated full attention:
``config.py`` (its config, the engine's ``HybridArch`` and the registry's config type),
``params.py`` (the parameter table) and ``model.py`` (its caches and the forward)."""

from jaxllm.models.qwen3_next.config import (ARCHITECTURES, HybridArch, HybridConfig, Qwen3NextConfig, config_from_hf,
                                             num_full_layers, num_gdn_layers)
from jaxllm.models.qwen3_next.model import (CHUNK_SIZE, PER_SEQUENCE_STATE, allocate_cache, cache_kinds, compute_logits,
                                            forward, mlp)
from jaxllm.models.qwen3_next.params import PARAMS, grouped_channels

__all__ = ["ARCHITECTURES", "CHUNK_SIZE", "PARAMS", "PER_SEQUENCE_STATE", "HybridArch", "HybridConfig",
           "Qwen3NextConfig", "allocate_cache", "cache_kinds", "compute_logits", "config_from_hf", "forward",
           "grouped_channels", "mlp", "num_full_layers", "num_gdn_layers"]

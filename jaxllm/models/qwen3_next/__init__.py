"""The hybrid family: Qwen3-Next and Qwen3.5, Gated DeltaNet and gated full attention
(``model.py``: its config, parameter table, caches and forward)."""

from jaxllm.models.qwen3_next.model import (ARCHITECTURES, CHUNK_SIZE, PARAMS, PER_SEQUENCE_STATE, HybridArch,
                                            HybridConfig, Qwen3NextConfig, allocate_cache, cache_kinds, compute_logits,
                                            config_from_hf, forward, grouped_channels, mlp, num_full_layers,
                                            num_gdn_layers)

__all__ = ["ARCHITECTURES", "CHUNK_SIZE", "PARAMS", "PER_SEQUENCE_STATE", "HybridArch", "HybridConfig",
           "Qwen3NextConfig", "allocate_cache", "cache_kinds", "compute_logits", "config_from_hf", "forward",
           "grouped_channels", "mlp", "num_full_layers", "num_gdn_layers"]

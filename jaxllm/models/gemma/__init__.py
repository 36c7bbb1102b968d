"""The Gemma 2/3 family (``model.py``: its config reader, parameter table and forward)."""

from jaxllm.models.gemma.model import (ARCHITECTURES, PARAMS, arch_config, compute_logits, forward, gemma_norm,
                                       rope_tables)

__all__ = ["ARCHITECTURES", "PARAMS", "arch_config", "compute_logits", "forward", "gemma_norm", "rope_tables"]

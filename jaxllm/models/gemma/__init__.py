"""The Gemma 2/3 family: ``config.py`` (its config reader and RoPE tables), ``params.py`` (the
parameter table, HF and GGUF names) and ``model.py`` (the forward)."""

from jaxllm.models.gemma.config import ARCHITECTURES, arch_config, rope_tables
from jaxllm.models.gemma.model import compute_logits, forward, gemma_norm
from jaxllm.models.gemma.params import PARAMS

__all__ = ["ARCHITECTURES", "PARAMS", "arch_config", "compute_logits", "forward", "gemma_norm", "rope_tables"]

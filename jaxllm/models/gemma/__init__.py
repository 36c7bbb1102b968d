"""The Gemma 2/3 family: ``config.py`` (its config, HF and GGUF, and RoPE tables), ``params.py`` (the
parameter table, HF and GGUF names) and ``model.py`` (the forward)."""

from jaxllm.models.gemma.config import ARCHITECTURES, GemmaConfig, rope_tables
from jaxllm.models.gemma.model import compute_logits, forward, gemma_norm
from jaxllm.models.gemma.params import PARAMS

__all__ = ["ARCHITECTURES", "GemmaConfig", "PARAMS", "compute_logits", "forward", "gemma_norm", "rope_tables"]

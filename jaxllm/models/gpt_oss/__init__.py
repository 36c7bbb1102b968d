"""The GPT-OSS family: ``config.py`` (its config reader), ``params.py`` (the parameter table, HF
and GGUF names) and ``model.py`` (the forward)."""

from jaxllm.models.gpt_oss.config import ROPE_TYPES, arch_config
from jaxllm.models.gpt_oss.model import compute_logits, forward, route
from jaxllm.models.gpt_oss.params import EXPERT_PARAMS, PARAMS

__all__ = ["EXPERT_PARAMS", "PARAMS", "ROPE_TYPES", "arch_config", "compute_logits", "forward", "route"]

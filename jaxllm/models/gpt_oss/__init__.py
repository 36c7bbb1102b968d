"""The GPT-OSS family: ``config.py`` (its config, HF and GGUF), ``params.py`` (the parameter table, HF
and GGUF names) and ``model.py`` (the forward)."""

from jaxllm.models.gpt_oss.config import ROPE_TYPES, GptOssConfig
from jaxllm.models.gpt_oss.model import compute_logits, forward, route
from jaxllm.models.gpt_oss.params import EXPERT_PARAMS, PARAMS

__all__ = ["EXPERT_PARAMS", "GptOssConfig", "PARAMS", "ROPE_TYPES", "compute_logits", "forward", "route"]

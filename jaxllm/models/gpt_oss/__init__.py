"""The GPT-OSS family (``model.py``: its config reader, parameter table and forward)."""

from jaxllm.models.gpt_oss.model import EXPERT_PARAMS, PARAMS, ROPE_TYPES, arch_config, compute_logits, forward, route

__all__ = ["EXPERT_PARAMS", "PARAMS", "ROPE_TYPES", "arch_config", "compute_logits", "forward", "route"]

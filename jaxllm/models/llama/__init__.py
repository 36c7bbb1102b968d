"""The Llama family: Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, and the variants of the same
decoder (Phi-3, SmolLM3, OLMo 2/3, Granite, GLM-4-MoE) that differ only in ``ArchConfig``
switches.

* ``config.py``: ``arch_config`` (a transformers config) and ``gguf_arch_config`` (llama.cpp's llama
  layout's metadata) -> ``ArchConfig``; ``variants.py`` reads the variants' switches;
* ``params.py``: the parameter table (HF and GGUF names, what the converter changed);
* ``model.py``: the forward.
"""

from jaxllm.models.llama.config import arch_config, gguf_arch_config
from jaxllm.models.llama.model import compute_logits, forward
from jaxllm.models.llama.params import EXPERT_PARAMS, PARAMS

__all__ = ["EXPERT_PARAMS", "PARAMS", "arch_config", "compute_logits", "forward", "gguf_arch_config"]

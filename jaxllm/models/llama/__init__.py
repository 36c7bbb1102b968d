"""The Llama family: Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, and the variants of the same
decoder (Phi-3, SmolLM3, OLMo 2/3, Granite, GLM-4-MoE) that differ only in ``ArchConfig``
switches.

* ``config.py``: ``LlamaConfig.from_hf`` (a transformers config) and ``LlamaConfig.from_gguf``
  (llama.cpp's metadata) -> ``ArchConfig``; ``variants.py`` reads the variants' switches, HF and GGUF;
* ``params.py``: the parameter table (HF and GGUF names, what the converter changed);
* ``model.py``: the forward.
"""

from jaxllm.models.llama.config import LlamaConfig
from jaxllm.models.llama.model import compute_logits, forward
from jaxllm.models.llama.params import EXPERT_PARAMS, PARAMS

__all__ = ["EXPERT_PARAMS", "LlamaConfig", "PARAMS", "compute_logits", "forward"]

"""jaxllm: an LLM inference engine whose hot path is compiled by XLA.

    from jaxllm import LLM, SamplingParams

The public names are imported lazily, so that the pure-Python parts (``jaxllm.core``,
``jaxllm.sampling_params``) can be used and tested without importing JAX.
"""

import os

# jaxllm needs no torch; transformers' import-time advice that PyTorch is missing is noise here.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__all__ = ["LLM", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput", "LoRARequest"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "LLM":
        from jaxllm.llm import LLM
        return LLM
    if name == "SamplingParams":
        from jaxllm.sampling_params import SamplingParams
        return SamplingParams
    if name == "PoolingParams":
        from jaxllm.pooling.params import PoolingParams
        return PoolingParams
    if name == "LoRARequest":
        from jaxllm.lora.request import LoRARequest
        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput"):
        from jaxllm import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")

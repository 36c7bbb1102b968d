"""jaxllm: an LLM inference engine whose hot path is compiled by XLA.

    from jaxllm import LLM, SamplingParams
"""

from jaxllm.llm import LLM
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

"""The whole step as one pure function: forward, logits of the sampled rows, sampling.

``step(params, kv, inputs) -> (kv, SamplerOutput)`` is what gets compiled per bucket; the
KV cache argument is donated, so the cache is updated in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import jax

from jaxllm.layers.attention import AttentionMetadata
from jaxllm.models.config import ArchConfig
from jaxllm.sample.sampler import SamplingMetadata, sample


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInputs:
    input_ids: jax.Array        # [T] int32
    attn: AttentionMetadata
    logits_indices: jax.Array   # [S] int32, the flat index of each row's last token
    sampling: SamplingMetadata


def make_step(arch: ArchConfig, model: ModuleType, max_logprobs: int):
    def step(params, kv, inputs: StepInputs):
        hidden, kv = model.forward(arch, params, kv, inputs.input_ids, inputs.attn)   # [T, D]
        logits = model.compute_logits(arch, params, hidden[inputs.logits_indices])   # [S, V]
        return kv, sample(logits, inputs.sampling, max_logprobs)
    return step

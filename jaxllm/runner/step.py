"""A step as two pure functions, each compiled ahead of time: the model, then the sampler.

``step(params, kv, sampler_state, inputs) -> (kv, sampler_state, logits [S, V], prompt
logprobs)`` is compiled per bucket (T, S): forward, the logits of the sampled rows, the
sampler state's update (penalty counts) and prompt logprobs.  The KV cache and the sampler
state are donated, so both are updated in place.  A pooling engine's step
(``cfg.pooling_type``) also returns ``pooled`` [S, D] float32: per sequence, the final-norm
hidden state at the row's last token (LAST: the rows the LM head would read) or the sum
over the sequence's tokens of this step (MEAN: the runner adds the chunks up); it skips the LM
head and prompt logprobs (its logits are zeros: no sampler runs after a pooling step, the
runner's placeholder tokens are dropped by the scheduler), which keeps its programs cheap to compile.

``sample_step(sampler_state, logits, sampling, allowed) -> SamplerOutput`` is compiled per
sequence bucket S only (``allowed``: the grammar's ``[S, ceil(V / 32)]`` uint32 bitmask, filled
on the host while the step runs).  The sampler does not depend on the model, and it was ~85% of a step's
compile time (the tiny test model: 1.6-2.5 s without it, 14-15.5 s with it, measured with the
machine loaded): compiled once per S instead of once per (T, S), and shared through the
persistent cache by every model with the same vocabulary and sampler settings.  The cost
is one more executable call per step, the logits staying on the device between the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.layers.attention import AttentionMetadata
from jaxllm.lora.apply import LoRAStep, kernel_for, transposes_a
from jaxllm.models.registry import keeps_sequence_state
from jaxllm.parallel.mesh import tp_size
from jaxllm.runner.step_config import StepConfig
from jaxllm.sample.sampler import SamplerState, SamplingMetadata, prompt_logprobs, sample, update_state


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInputs:
    input_ids: jax.Array        # [T] int32
    attn: AttentionMetadata
    logits_indices: jax.Array   # [S] int32, the flat index of the token each sampling row draws after
    token_row: jax.Array        # [T] int32, the sampling row each token's penalty counts go through
    sampling: SamplingMetadata
    prompt_targets: jax.Array   # [T] int32, next prompt token for prompt_logprobs, -1: not asked
    state_slots: jax.Array      # [S] int32, each sequence's per-sequence state slot (runner/state_slots.py)
    lora_slots: jax.Array | None = None   # [T] int32, each token's LoRA slot (-1: none); None: LoRA off
    lora_used: jax.Array | None = None    # [max_loras] int32, the distinct slots in lora_slots, then -1s
    image_row: jax.Array | None = None    # [T] int32, t for a token that takes image_embeds[t], else -1; None: no images
    image_embeds: jax.Array | None = None  # [T, D] float32, the image rows at their tokens (zeros elsewhere)
    rope_positions: jax.Array | None = None  # [3, T] int32, M-RoPE (t, h, w) positions; None: no M-RoPE


def make_step(cfg: StepConfig, model: ModuleType):
    """``model``: the model family's module (models/registry.py)."""
    arch, kernels, K = cfg.arch, cfg.kernels, max(cfg.max_logprobs, 1)
    # A family with per-sequence state (models/qwen3_next/) reads each sequence's slot.
    stateful = keeps_sequence_state(arch.architecture)
    lora_kernel = kernel_for(kernels)
    lora_a_transposed = transposes_a(lora_kernel, cfg.lora_dtype)   # as model_runner.py's slots hold it

    def logits_of(params, hidden):
        return model.compute_logits(arch, params, hidden, kernels)

    def step(params, kv, sstate: SamplerState, inputs: StepInputs):
        extra = {"state_slots": inputs.state_slots} if stateful else {}
        if cfg.max_loras:
            extra["lora"] = LoRAStep(params["lora"], inputs.lora_slots, inputs.lora_used, lora_kernel,
                                     lora_a_transposed)
        if inputs.image_row is not None:
            # a vision-language model: the image tokens take the encoder's rows (runner/vision.py)
            extra["image_rows"] = (inputs.image_row, inputs.image_embeds)
        if inputs.rope_positions is not None:
            # Qwen3.5 with images: the rotary turns by the (t, h, w) positions (runner/inputs.py)
            extra["rope_positions"] = inputs.rope_positions
        hidden, kv = model.forward(arch, params, kv, inputs.input_ids, inputs.attn, kernels, **extra)   # [T, D]
        if cfg.pooling_type:
            # A pooling step samples nothing (runner/model_runner.py runs no sampler after it):
            # no LM head and no prompt logprobs to compile or run, zero logits [S, V].
            S = inputs.logits_indices.shape[0]
            sstate = update_state(sstate, inputs.sampling, inputs.input_ids, inputs.token_row,
                                  inputs.attn.positions, inputs.attn.query_start_loc[-1])
            T = inputs.input_ids.shape[0]
            plp = (jnp.zeros((T,), jnp.float32), jnp.zeros((T,), jnp.int32), jnp.zeros((T, K), jnp.int32),
                   jnp.zeros((T, K), jnp.float32))
            return (kv, sstate, jnp.zeros((S, arch.vocab_size), jnp.float32), plp,
                    pooled_rows(cfg.pooling_type, hidden, inputs))
        logits = logits_of(params, hidden[inputs.logits_indices])        # [S, V]
        if tp_size() > 1:
            # Vocabulary-parallel LM head: gather the (small) logits so the sampler, and its
            # Pallas reduction, run on whole rows on every device.
            logits = jax.lax.with_sharding_constraint(logits, P())
        attn = inputs.attn
        sstate = update_state(sstate, inputs.sampling, inputs.input_ids, inputs.token_row, attn.positions,
                              attn.query_start_loc[-1])
        T = inputs.input_ids.shape[0]

        def with_prompt_logprobs():
            return prompt_logprobs(lambda h: logits_of(params, h), hidden, inputs.prompt_targets, K)

        def without():
            return (jnp.zeros((T,), jnp.float32), jnp.zeros((T,), jnp.int32), jnp.zeros((T, K), jnp.int32),
                    jnp.zeros((T, K), jnp.float32))

        plp = jax.lax.cond(jnp.any(inputs.prompt_targets >= 0), with_prompt_logprobs, without)
        return kv, sstate, logits, plp
    return step


def pooled_rows(pooling_type: str, hidden, inputs: StepInputs):
    """hidden [T, D] -> [S, D] float32: LAST, each sequence's last token of the step (the LM head's
    rows); MEAN, the sum of its tokens of the step (padding tokens, past ``qsl[-1]``, excluded)."""
    hidden = hidden.astype(jnp.float32)
    if pooling_type == "LAST":
        return hidden[inputs.logits_indices]                                           # [S, D]
    S, T = inputs.logits_indices.shape[0], hidden.shape[0]
    attn = inputs.attn
    real = jnp.arange(T, dtype=jnp.int32) < attn.query_start_loc[-1]                   # [T]
    member = ((attn.token_seq[None, :] == jnp.arange(S, dtype=jnp.int32)[:, None]) & real[None, :])   # [S, T]
    return jax.lax.dot_general(member.astype(jnp.float32), hidden, (((1,), (0,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def make_sample_step(cfg: StepConfig):
    kernels = {} if cfg.sampler_backend == "xla" else {"kernel_backend": cfg.sampler_backend}

    def sample_step(sstate: SamplerState, logits: jax.Array, sampling: SamplingMetadata, allowed: jax.Array):
        """logits [S, V] float32 of the step just run, and the state it left; allowed [S, W] uint32."""
        return sample(logits, sampling, sstate, allowed, max_logprobs=cfg.max_logprobs, logprobs_mode=cfg.logprobs_mode,
                      fp64=cfg.use_fp64_gumbel, **kernels)
    return sample_step

"""Architecture registry, keyed by the HF architecture name in ``config.json``.

Each entry names the module that implements the forward; architectures that differ only
in ``ArchConfig`` flags share one module.
"""

from __future__ import annotations

from types import ModuleType

from jaxllm.errors import ModelLoadError
from jaxllm.models import deepseek, gemma, gguf_arch, gpt_oss, llama, qwen3_next

_REGISTRY: dict[str, ModuleType] = {
    "LlamaForCausalLM": llama,
    "MistralForCausalLM": llama,
    "Qwen2ForCausalLM": llama,
    "Qwen3ForCausalLM": llama,
    "Qwen3MoeForCausalLM": llama,   # sparse MoE MLP: layers/moe.py
    "MixtralForCausalLM": llama,
    "Gemma2ForCausalLM": gemma,
    "Gemma3ForCausalLM": gemma,
    "GptOssForCausalLM": gpt_oss,   # sinks, YaRN, biased experts with the clamped SwiGLU
    # models/families_b.py reads their configs into ArchConfig switches of the same decoder.
    "Phi3ForCausalLM": llama,
    "SmolLM3ForCausalLM": llama,
    "Olmo2ForCausalLM": llama,
    "Olmo3ForCausalLM": llama,
    "GraniteForCausalLM": llama,
    "Glm4MoeForCausalLM": llama,   # dense first layers, then MoE with shared experts
    # MLA: one latent per token in the cache (layers/mla_attention.py), routed + shared experts.
    "DeepseekV2ForCausalLM": deepseek,
    "DeepseekV3ForCausalLM": deepseek,
    # Hybrid: Gated DeltaNet layers (a recurrent state per sequence) and gated full attention.
    "Qwen3NextForCausalLM": qwen3_next,
    "Qwen3_5ForCausalLM": qwen3_next,
    "Qwen3_5MoeForCausalLM": qwen3_next,
}

# GGUF's general.architecture -> HF architecture name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    # Gemma 2/3, Phi-3, SmolLM3, OLMo 2 (and 3), Granite, GLM-4-MoE, GPT-OSS: models/gguf_arch.py
    **gguf_arch.ARCHITECTURES,
}


def gguf_hf_architectures() -> set[str]:
    """The HF architectures a GGUF file can load as (OLMo 3 comes as llama.cpp's olmo2)."""
    return set(GGUF_ARCHITECTURES.values()) | {"Olmo3ForCausalLM"}


def config_reader(architecture: str):
    """The family's own config reader (``arch_config(hf, arch, where)``) for an architecture
    whose module has one, else None (``models/config.arch_config_from_hf`` reads it)."""
    module = _REGISTRY.get(architecture)
    return getattr(module, "arch_config", None) if module is not None else None


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_module(architecture: str) -> ModuleType:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        ) from None


def keeps_sequence_state(architecture: str) -> bool:
    """Whether the family keeps state per sequence besides its K/V pages (a hybrid model's
    recurrent GDN state, models/qwen3_next.py): the runner then gives each request a state
    slot, and prefix caching and speculative decoding do not apply."""
    return getattr(get_model_module(architecture), "PER_SEQUENCE_STATE", False)

"""Architecture registry, keyed by the HF architecture name in ``config.json``.

Each entry is a :class:`Family`: the module that implements the forward (its ``PARAMS``,
``forward``, ``compute_logits``), its config type (``from_hf`` / ``from_gguf``) and what else
the family provides the engine, declared once; architectures that differ only in
``ArchConfig`` flags share one family.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from dataclasses import dataclass
from types import ModuleType

from jaxllm.errors import ModelLoadError
from jaxllm.models import bert, deepseek, gemma, gemma3_vl, gpt_oss, llama, modernbert, qwen3_5_vl, qwen3_next
from jaxllm.models.config import ArchConfig, FamilyConfig


@dataclass(frozen=True)
class Family:
    """A model family's contract with the loader, the runner and the engine.  A capability
    left None is the default: K/V pages in every layer, one RoPE table, no state per sequence."""

    module: ModuleType
    """Its parameter table (``PARAMS``), ``forward`` and ``compute_logits``."""
    config: type[FamilyConfig]
    """The family's config type: ``from_hf`` (a transformers config) and ``from_gguf`` (a GGUF
    file's metadata) give its ``ArchConfig``."""
    cache_kinds: Callable | None = None
    """``(arch, itemsize, kv_cache_dtype) -> CacheKind``s the KV budget sizes (engine/resolve.py)."""
    allocate_cache: Callable | None = None
    """``(arch, num_blocks, block_size, dtype, stacked, make=, sharding=[, num_seqs=])``: the
    family's own cache arrays (runner/model_runner.py); None: ``runner/weights.allocate_kv_cache``."""
    rope_tables: Callable | None = None
    """``arch -> {name: (theta, RopeScaling)}``: further RoPE frequency tables (Gemma 3's local base)."""
    per_sequence_state: bool = False
    """A state per sequence besides the K/V pages (a hybrid model's recurrent GDN state): the
    runner gives each request a state slot; prefix caching and speculative decoding do not apply."""
    pooling: bool = False
    """An encoder that pools rather than generates (BERT, ModernBERT): its module has ``encode``
    and ``classify`` (a cross-encoder's head) instead of ``forward`` / ``compute_logits``, it
    runs under the pooling runner (``jaxllm/pooling/``), and ``runner="auto"`` picks that runner
    for it.  A module that also has ``encoder_layout`` (BERT) runs steps of short prompts in
    narrower grid programs (``pooling/runner.py``)."""
    ignored_tensors: tuple[str, ...] = ()
    """Checkpoint tensor names (or name prefixes ending in ``.``) the loader skips: heads and
    buffers the family does not use (BERT's NSP pooler and masked-LM head)."""
    lora: bool = False
    """Its layers add LoRA deltas (``forward(..., lora=)``; lora/apply.py) to the projections
    ``lora/targets.py`` reads off its parameter table."""
    vision: ModuleType | None = None
    """A vision-language model's image side (``split_checkpoint``, ``encode``, placeholder
    expansion: models/gemma3_vl/, models/qwen3_5_vl/): the engine takes images (``supports_images``)."""
    mrope: bool = False
    """With images, its forward takes M-RoPE ``rope_positions`` [3, T] (Qwen3.5): the engine's
    step carries them (``StepConfig.mrope``)."""


DECODER = Family(llama, config=llama.LlamaConfig, lora=True)
GEMMA = Family(gemma, config=gemma.GemmaConfig, rope_tables=gemma.rope_tables, lora=True)
GEMMA_VL = Family(gemma, config=gemma.GemmaConfig, rope_tables=gemma.rope_tables, vision=gemma3_vl)
GPT_OSS = Family(gpt_oss, config=gpt_oss.GptOssConfig)
MLA = Family(deepseek, config=deepseek.DeepseekConfig, cache_kinds=deepseek.cache_kinds,
             allocate_cache=deepseek.allocate_cache)
HYBRID = Family(qwen3_next, config=qwen3_next.Qwen3NextConfig, cache_kinds=qwen3_next.cache_kinds,
                allocate_cache=qwen3_next.allocate_cache, per_sequence_state=qwen3_next.PER_SEQUENCE_STATE)
# Qwen3.5 with images: the hybrid text model with M-RoPE; its vision side (models/qwen3_5_vl/)
HYBRID_VL = dataclasses.replace(HYBRID, vision=qwen3_5_vl, mrope=True)
ENCODER = Family(bert, config=bert.BertConfig, pooling=True, ignored_tensors=bert.IGNORED_TENSORS)
CROSS_ENCODER = Family(bert, config=bert.BertConfig, pooling=True, ignored_tensors=bert.CLASSIFIER_IGNORED_TENSORS)
MODERNBERT = Family(modernbert, config=modernbert.ModernBertConfig, pooling=True,
                    ignored_tensors=modernbert.IGNORED_TENSORS)
MODERNBERT_CROSS_ENCODER = Family(modernbert, config=modernbert.ModernBertConfig, pooling=True,
                                  ignored_tensors=modernbert.CLASSIFIER_IGNORED_TENSORS)

_REGISTRY: dict[str, Family] = {
    "LlamaForCausalLM": DECODER,
    "MistralForCausalLM": DECODER,
    "Qwen2ForCausalLM": DECODER,
    "Qwen3ForCausalLM": DECODER,
    "Qwen3MoeForCausalLM": DECODER,   # sparse MoE MLP: layers/moe.py
    "MixtralForCausalLM": DECODER,
    "Gemma2ForCausalLM": GEMMA,
    "Gemma3ForCausalLM": GEMMA,
    "Gemma3ForConditionalGeneration": GEMMA_VL,   # + SigLIP images (models/gemma3_vl/)
    "GptOssForCausalLM": GPT_OSS,   # sinks, YaRN, biased experts with the clamped SwiGLU
    # models/llama/variants.py reads their configs into ArchConfig switches of the same decoder.
    "Phi3ForCausalLM": DECODER,
    "SmolLM3ForCausalLM": DECODER,
    "Olmo2ForCausalLM": DECODER,
    "Olmo3ForCausalLM": DECODER,
    "GraniteForCausalLM": DECODER,
    "Glm4MoeForCausalLM": DECODER,   # dense first layers, then MoE with shared experts
    # MLA: one latent per token in the cache (layers/mla_attention.py), routed + shared experts.
    "DeepseekV2ForCausalLM": MLA,
    "DeepseekV3ForCausalLM": MLA,
    # Hybrid: Gated DeltaNet layers (a recurrent state per sequence) and gated full attention.
    "Qwen3NextForCausalLM": HYBRID,
    "Qwen3_5ForCausalLM": HYBRID,
    "Qwen3_5MoeForCausalLM": HYBRID,
    "Qwen3_5ForConditionalGeneration": HYBRID_VL,   # text served; images: models/qwen3_5_vl/ (not in the engine yet)
    # Encoders (bidirectional, pooled; the pooling runner): BertModel is what sentence-transformers saves.
    "BertModel": ENCODER,
    "BertForMaskedLM": ENCODER,
    "RobertaModel": ENCODER,            # BERT with positions offset past the padding id
    "RobertaForMaskedLM": ENCODER,
    "XLMRobertaModel": ENCODER,
    "XLMRobertaForMaskedLM": ENCODER,
    "BertForSequenceClassification": CROSS_ENCODER,   # a cross-encoder: /score, /rerank
    "RobertaForSequenceClassification": CROSS_ENCODER,     # RobertaClassificationHead over <s>
    "XLMRobertaForSequenceClassification": CROSS_ENCODER,  # bge-reranker-base / -large
    # ModernBERT: rotary, alternating local / global attention, GeGLU; no token types.
    "ModernBertModel": MODERNBERT,
    "ModernBertForMaskedLM": MODERNBERT,
    "ModernBertForSequenceClassification": MODERNBERT_CROSS_ENCODER,
}

# GGUF's general.architecture -> HF architecture name, as each family's config declares it
# (llama, mistral, qwen2, qwen3 and the Llama variants; gemma2/3; gpt-oss).
GGUF_ARCHITECTURES = {**llama.config.GGUF_ARCHITECTURES, **gemma.config.GGUF_ARCHITECTURES,
                      **gpt_oss.config.GGUF_ARCHITECTURES}


def gguf_hf_architectures() -> set[str]:
    """The HF architectures a GGUF file can load as (OLMo 3 comes as llama.cpp's olmo2)."""
    return set(GGUF_ARCHITECTURES.values()) | {"Olmo3ForCausalLM"}


def read_config(hf, where: str) -> ArchConfig:
    """A transformers ``PretrainedConfig`` -> its family's ``ArchConfig`` (``Family.config.from_hf``)."""
    arch = (getattr(hf, "architectures", None) or [None])[0]
    if arch is None:
        raise ModelLoadError(f"{where}: config.json names no architecture")
    return get_family(arch).config.from_hf(hf, arch, where)


def read_gguf_config(fields: dict, tensors: dict, path: str, read=None) -> ArchConfig:
    """A GGUF file's metadata -> its family's ``ArchConfig`` (``Family.config.from_gguf``;
    ``tensors``: name -> shape as GGUF stores it; ``read``: a config tensor's values by name)."""
    gguf_name = fields.get("general.architecture")
    if gguf_name not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {gguf_name!r} is not supported; "
                             f"supported: {', '.join(sorted(GGUF_ARCHITECTURES))}")
    return get_family(GGUF_ARCHITECTURES[gguf_name]).config.from_gguf(fields, tensors, gguf_name, path, read)


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_family(architecture: str) -> Family:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        ) from None


def get_model_module(architecture: str) -> ModuleType:
    """The module that implements ``architecture``'s forward (its family's ``module``)."""
    return get_family(architecture).module


def is_pooling(architecture: str) -> bool:
    """Whether the family is an encoder served by the pooling runner (:attr:`Family.pooling`)."""
    return get_family(architecture).pooling


def keeps_sequence_state(architecture: str) -> bool:
    """Whether the family keeps state per sequence besides its K/V pages (:attr:`Family.per_sequence_state`)."""
    return get_family(architecture).per_sequence_state

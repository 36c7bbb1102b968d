"""BERT's config (:class:`BertConfig`): a transformers ``BertConfig`` (or RoBERTa / XLM-RoBERTa's,
the same encoder with its positions offset) -> ``ArchConfig`` with the encoder's own knobs in
``ArchConfig.encoder`` (token types, LayerNorm epsilon, the MLP's GELU, the position offset)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.errors import ModelLoadError
from jaxllm.layers.rotary import RopeScaling
from jaxllm.models.config import ArchConfig, FamilyConfig

# transformers' names of the exact (erf) GELU and of its tanh approximation.
GELU_EXACT = ("gelu",)
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# RoBERTa's positions start after the padding id: token i of a prompt has position pad_token_id + 1 + i
# (transformers' ``create_position_ids_from_input_ids``, for prompts without padding inside).
ROBERTA_CLASSIFIERS = ("RobertaForSequenceClassification", "XLMRobertaForSequenceClassification")
CLASSIFIERS = ("BertForSequenceClassification", *ROBERTA_CLASSIFIERS)
OFFSET_POSITIONS = ("RobertaModel", "RobertaForMaskedLM", "XLMRobertaModel", "XLMRobertaForMaskedLM",
                    *ROBERTA_CLASSIFIERS)


@dataclass(frozen=True)
class BertConfig(FamilyConfig):
    """An encoder's own knobs (``ArchConfig.encoder``) and its reader (the registry's ``Family.config``)."""

    type_vocab_size: int = 2
    """Rows of the token-type embedding; every token of a single-text input is type 0."""
    layer_norm_eps: float = 1e-12
    gelu_tanh: bool = False
    """The MLP's GELU: False the exact (erf) one, True the tanh approximation."""
    num_labels: int = 0
    """A cross-encoder's classifier outputs (``*ForSequenceClassification``: a tanh layer over
    the first token, then a linear head: BERT's pooler and classifier, RoBERTa's
    ``RobertaClassificationHead``); 0: an embedder, no head."""
    position_offset: int = 0
    """Added to each token's position before the position-embedding lookup (0 for BERT; RoBERTa's
    ``pad_token_id + 1``)."""

    @classmethod
    def from_hf(cls, hf, arch: str, where: str) -> ArchConfig:
        return _from_hf(hf, arch, where)


def encoder(arch: ArchConfig) -> BertConfig:
    """The encoder section of ``arch`` (a BERT-family ``ArchConfig`` always has one)."""
    assert isinstance(arch.encoder, BertConfig), arch.architecture
    return arch.encoder


def _from_hf(hf, arch: str, where: str) -> ArchConfig:
    """A ``BertConfig`` -> ArchConfig; refuses by name what the encoder does not implement."""
    def get(name, default=None):
        v = getattr(hf, name, None)
        return default if v is None else v

    act = get("hidden_act", "gelu")
    if act not in GELU_EXACT + GELU_TANH:
        raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported for {arch} "
                             f"(supported: {', '.join(GELU_EXACT + GELU_TANH)})")
    pos_type = get("position_embedding_type", "absolute")
    if pos_type != "absolute":
        raise ModelLoadError(f"{where}: position_embedding_type {pos_type!r} is not supported for {arch} "
                             "(absolute only)")
    heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    if hidden % heads:
        raise ModelLoadError(f"{where}: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})")
    eps = float(get("layer_norm_eps", 1e-12))
    offset = 0
    if arch in OFFSET_POSITIONS:
        pad = get("pad_token_id")
        if pad is None:
            raise ModelLoadError(f"{where}: {arch} needs pad_token_id (its positions start after it)")
        offset = int(pad) + 1
    return ArchConfig(
        architecture=arch,
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_layers=int(get("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        rms_norm_eps=eps,
        rope_theta=10000.0,            # unused: absolute positions
        rope_scaling=RopeScaling(),
        max_position_embeddings=int(get("max_position_embeddings", 512)),
        tie_word_embeddings=False,
        qkv_bias=True,
        o_bias=True,
        encoder=BertConfig(type_vocab_size=int(get("type_vocab_size", 2)), layer_norm_eps=eps,
                           gelu_tanh=act in GELU_TANH, position_offset=offset,
                           num_labels=int(get("num_labels", 1)) if arch in CLASSIFIERS else 0),
    )

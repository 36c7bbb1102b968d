"""BERT's parameter table: every weight with its HF safetensors names, as ``BertModel`` /
``XLMRobertaModel`` save them (a sentence-transformers folder) or under ``bert.`` / ``roberta.``
(the masked-LM heads' and the sequence classifiers' checkpoints).  Encoders have no GGUF form here."""

from __future__ import annotations

from jaxllm.models.bert.config import ROBERTA_CLASSIFIERS
from jaxllm.models.params import GLOBAL, LAYER, MATRIX, VECTOR, Param, ParamTable

PREFIXES = ("", "bert.", "roberta.")
CLASSIFIER_IGNORED_TENSORS = (*(p + "embeddings.position_ids" for p in PREFIXES), "roberta.pooler.")
"""A BERT cross-encoder uses its pooler (the classifier reads it); a RoBERTa one reads its own
``classifier.dense`` instead, so a pooler saved beside it is skipped."""
IGNORED_TENSORS = (*(p + "pooler." for p in PREFIXES), *(p + "embeddings.position_ids" for p in PREFIXES),
                   "cls.", "lm_head.")
"""Checkpoint tensors the encoder does not use: the NSP pooler, the masked-LM heads (BERT's
``cls.``, RoBERTa's ``lm_head.``), the saved position-id buffer.  The loader skips them
(``Family.ignored_tensors``)."""


def _hf(suffix: str) -> tuple[str, ...]:
    return tuple(p + suffix for p in PREFIXES)


def _layer(suffix: str) -> tuple[str, ...]:
    return _hf("encoder.layer.{layer}." + suffix)


def _head(bert: tuple[str, ...], roberta: str) -> dict[str, tuple[str, ...]]:
    """A head tensor's names: BERT's (``"*"``), and RoBERTa / XLM-RoBERTa classifiers' own."""
    return {"*": bert, **{arch: (roberta,) for arch in ROBERTA_CLASSIFIERS}}


def _classifier(a) -> bool:
    return a.encoder.num_labels > 0


def _width(a):
    return (a.hidden_size,)


def _square(a):
    return (a.hidden_size, a.hidden_size)


PARAMS = ParamTable(params=(
    Param("embed", GLOBAL, MATRIX, ("vocab", "embed"), lambda a: (a.vocab_size, a.hidden_size),
          _hf("embeddings.word_embeddings.weight")),
    Param("pos_embed", GLOBAL, MATRIX, ("positions", "embed"), lambda a: (a.max_position_embeddings, a.hidden_size),
          _hf("embeddings.position_embeddings.weight")),
    Param("type_embed", GLOBAL, MATRIX, ("token_types", "embed"),
          lambda a: (a.encoder.type_vocab_size, a.hidden_size), _hf("embeddings.token_type_embeddings.weight")),
    Param("embed_norm", GLOBAL, VECTOR, ("embed",), _width, _hf("embeddings.LayerNorm.weight")),
    Param("embed_norm_bias", GLOBAL, VECTOR, ("embed",), _width, _hf("embeddings.LayerNorm.bias")),
    Param("q", LAYER, MATRIX, ("q", "embed"), _square, _layer("attention.self.query.weight")),
    Param("q_bias", LAYER, VECTOR, ("q",), _width, _layer("attention.self.query.bias")),
    Param("k", LAYER, MATRIX, ("kv", "embed"), _square, _layer("attention.self.key.weight")),
    Param("k_bias", LAYER, VECTOR, ("kv",), _width, _layer("attention.self.key.bias")),
    Param("v", LAYER, MATRIX, ("kv", "embed"), _square, _layer("attention.self.value.weight")),
    Param("v_bias", LAYER, VECTOR, ("kv",), _width, _layer("attention.self.value.bias")),
    Param("o", LAYER, MATRIX, ("embed", "q"), _square, _layer("attention.output.dense.weight")),
    Param("o_bias", LAYER, VECTOR, ("embed",), _width, _layer("attention.output.dense.bias")),
    Param("attn_norm", LAYER, VECTOR, ("embed",), _width, _layer("attention.output.LayerNorm.weight")),
    Param("attn_norm_bias", LAYER, VECTOR, ("embed",), _width, _layer("attention.output.LayerNorm.bias")),
    Param("up", LAYER, MATRIX, ("mlp", "embed"), lambda a: (a.intermediate_size, a.hidden_size),
          _layer("intermediate.dense.weight")),
    Param("up_bias", LAYER, VECTOR, ("mlp",), lambda a: (a.intermediate_size,), _layer("intermediate.dense.bias")),
    Param("down", LAYER, MATRIX, ("embed", "mlp"), lambda a: (a.hidden_size, a.intermediate_size),
          _layer("output.dense.weight")),
    Param("down_bias", LAYER, VECTOR, ("embed",), _width, _layer("output.dense.bias")),
    Param("mlp_norm", LAYER, VECTOR, ("embed",), _width, _layer("output.LayerNorm.weight")),
    Param("mlp_norm_bias", LAYER, VECTOR, ("embed",), _width, _layer("output.LayerNorm.bias")),
    # A cross-encoder's head: BertForSequenceClassification's tanh(pooler(h[CLS])) -> classifier;
    # (XLM-)RobertaForSequenceClassification's RobertaClassificationHead, the same sum under other
    # names: tanh(classifier.dense(h[<s>])) -> classifier.out_proj.
    Param("pooler", GLOBAL, MATRIX, ("embed", "embed"), _square,
          _head(_hf("pooler.dense.weight"), "classifier.dense.weight"), when=_classifier),
    Param("pooler_bias", GLOBAL, VECTOR, ("embed",), _width, _head(_hf("pooler.dense.bias"), "classifier.dense.bias"),
          when=_classifier),
    Param("classifier", GLOBAL, MATRIX, ("labels", "embed"), lambda a: (a.encoder.num_labels, a.hidden_size),
          _head(("classifier.weight",), "classifier.out_proj.weight"), when=_classifier),
    Param("classifier_bias", GLOBAL, VECTOR, ("labels",), lambda a: (a.encoder.num_labels,),
          _head(("classifier.bias",), "classifier.out_proj.bias"), when=_classifier),
))
"""BERT's parameters (safetensors names; float32 / bf16 / f16 checkpoints)."""

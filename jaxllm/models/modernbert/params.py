"""ModernBERT's parameter table: every weight with its HF safetensors names, as
``ModernBertModel`` saves them (a sentence-transformers folder) or under ``model.`` (the
masked-LM and sequence-classification checkpoints).  The fused ``Wqkv`` [3D, D] is read as three
chunks (q, k, v) and the GeGLU's ``Wi`` [2F, D] as two (the activated input first, then the
gate).  Encoders have no GGUF form here."""

from __future__ import annotations

from jaxllm.models.params import GLOBAL, LAYER, MATRIX, VECTOR, Chunk, Param, ParamTable

PREFIXES = ("", "model.")
IGNORED_TENSORS = ("head.", "decoder.")
"""Tensors an embedder does not use: the masked-LM head (``head.`` and the ``decoder``).  The
loader skips them (``Family.ignored_tensors``)."""
CLASSIFIER_IGNORED_TENSORS = ()
"""A cross-encoder reads every tensor (its ``head.`` feeds the ``classifier``)."""


def _hf(suffix: str) -> tuple[str, ...]:
    return tuple(p + suffix for p in PREFIXES)


def _layer(suffix: str) -> tuple[str, ...]:
    return _hf("layers.{layer}." + suffix)


def _chunks(suffix: str, index: int, count: int) -> tuple[Chunk, ...]:
    return tuple(Chunk(p + "layers.{layer}." + suffix, index, count, 0) for p in PREFIXES)


def _enc(field: str):
    return lambda a: bool(getattr(a.encoder, field))


def _classifier(a) -> bool:
    return a.encoder.num_labels > 0


def _after_first(a, layer: int) -> bool:
    """The first layer's attention norm is an identity: no weight."""
    return layer > 0


def _width(a):
    return (a.hidden_size,)


def _square(a):
    return (a.hidden_size, a.hidden_size)


def _mlp_in(a):
    return (a.intermediate_size, a.hidden_size)


_NORM_BIAS = _enc("norm_bias")
_ATTN_BIAS = _enc("attention_bias")
_MLP_BIAS = _enc("mlp_bias")

PARAMS = ParamTable(params=(
    Param("embed", GLOBAL, MATRIX, ("vocab", "embed"), lambda a: (a.vocab_size, a.hidden_size),
          _hf("embeddings.tok_embeddings.weight")),
    Param("embed_norm", GLOBAL, VECTOR, ("embed",), _width, _hf("embeddings.norm.weight")),
    Param("embed_norm_bias", GLOBAL, VECTOR, ("embed",), _width, _hf("embeddings.norm.bias"), when=_NORM_BIAS),
    Param("attn_norm", LAYER, VECTOR, ("embed",), _width, _layer("attn_norm.weight"), in_layer=_after_first),
    Param("attn_norm_bias", LAYER, VECTOR, ("embed",), _width, _layer("attn_norm.bias"), when=_NORM_BIAS,
          in_layer=_after_first),
    Param("q", LAYER, MATRIX, ("q", "embed"), _square, _chunks("attn.Wqkv.weight", 0, 3)),
    Param("k", LAYER, MATRIX, ("kv", "embed"), _square, _chunks("attn.Wqkv.weight", 1, 3)),
    Param("v", LAYER, MATRIX, ("kv", "embed"), _square, _chunks("attn.Wqkv.weight", 2, 3)),
    Param("q_bias", LAYER, VECTOR, ("q",), _width, _chunks("attn.Wqkv.bias", 0, 3), when=_ATTN_BIAS),
    Param("k_bias", LAYER, VECTOR, ("kv",), _width, _chunks("attn.Wqkv.bias", 1, 3), when=_ATTN_BIAS),
    Param("v_bias", LAYER, VECTOR, ("kv",), _width, _chunks("attn.Wqkv.bias", 2, 3), when=_ATTN_BIAS),
    Param("o", LAYER, MATRIX, ("embed", "q"), _square, _layer("attn.Wo.weight")),
    Param("o_bias", LAYER, VECTOR, ("embed",), _width, _layer("attn.Wo.bias"), when=_ATTN_BIAS),
    Param("mlp_norm", LAYER, VECTOR, ("embed",), _width, _layer("mlp_norm.weight")),
    Param("mlp_norm_bias", LAYER, VECTOR, ("embed",), _width, _layer("mlp_norm.bias"), when=_NORM_BIAS),
    Param("up", LAYER, MATRIX, ("mlp", "embed"), _mlp_in, _chunks("mlp.Wi.weight", 0, 2)),
    Param("gate", LAYER, MATRIX, ("mlp", "embed"), _mlp_in, _chunks("mlp.Wi.weight", 1, 2)),
    Param("up_bias", LAYER, VECTOR, ("mlp",), lambda a: (a.intermediate_size,), _chunks("mlp.Wi.bias", 0, 2),
          when=_MLP_BIAS),
    Param("gate_bias", LAYER, VECTOR, ("mlp",), lambda a: (a.intermediate_size,), _chunks("mlp.Wi.bias", 1, 2),
          when=_MLP_BIAS),
    Param("down", LAYER, MATRIX, ("embed", "mlp"), lambda a: (a.hidden_size, a.intermediate_size),
          _layer("mlp.Wo.weight")),
    Param("down_bias", LAYER, VECTOR, ("embed",), _width, _layer("mlp.Wo.bias"), when=_MLP_BIAS),
    Param("final_norm", GLOBAL, VECTOR, ("embed",), _width, _hf("final_norm.weight")),
    Param("final_norm_bias", GLOBAL, VECTOR, ("embed",), _width, _hf("final_norm.bias"), when=_NORM_BIAS),
    # A cross-encoder's head (ModernBertForSequenceClassification): classifier(norm(act(dense(pooled)))).
    Param("head_dense", GLOBAL, MATRIX, ("embed", "embed"), _square, "head.dense.weight", when=_classifier),
    Param("head_dense_bias", GLOBAL, VECTOR, ("embed",), _width, "head.dense.bias",
          when=lambda a: _classifier(a) and a.encoder.classifier_bias),
    Param("head_norm", GLOBAL, VECTOR, ("embed",), _width, "head.norm.weight", when=_classifier),
    Param("head_norm_bias", GLOBAL, VECTOR, ("embed",), _width, "head.norm.bias",
          when=lambda a: _classifier(a) and a.encoder.norm_bias),
    Param("classifier", GLOBAL, MATRIX, ("labels", "embed"), lambda a: (a.encoder.num_labels, a.hidden_size),
          "classifier.weight", when=_classifier),
    Param("classifier_bias", GLOBAL, VECTOR, ("labels",), lambda a: (a.encoder.num_labels,), "classifier.bias",
          when=_classifier),
))
"""ModernBERT's parameters (safetensors names; float32 / bf16 / f16 checkpoints)."""

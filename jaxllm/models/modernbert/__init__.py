"""The ModernBERT encoder family: ``config.py`` (its config), ``params.py`` (the parameter table,
HF names) and ``model.py`` (the bidirectional encoder forward and a cross-encoder's head, which
the pooling runner calls)."""

from jaxllm.models.modernbert.config import ModernBertConfig
from jaxllm.models.modernbert.model import classify, encode
from jaxllm.models.modernbert.params import CLASSIFIER_IGNORED_TENSORS, IGNORED_TENSORS, PARAMS

__all__ = ["CLASSIFIER_IGNORED_TENSORS", "IGNORED_TENSORS", "ModernBertConfig", "PARAMS", "classify", "encode"]

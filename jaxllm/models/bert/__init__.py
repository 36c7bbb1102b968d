"""The BERT encoder family: ``config.py`` (its config), ``params.py`` (the parameter table, HF names)
and ``model.py`` (the bidirectional encoder forward the pooling runner calls)."""

from jaxllm.models.bert.config import BertConfig
from jaxllm.models.bert.model import classify, encode, encoder_layout, prepare
from jaxllm.models.bert.params import CLASSIFIER_IGNORED_TENSORS, IGNORED_TENSORS, PARAMS

__all__ = ["BertConfig", "CLASSIFIER_IGNORED_TENSORS", "IGNORED_TENSORS", "PARAMS", "classify", "encode", "encoder_layout",
           "prepare"]

"""The BERT encoder family: ``config.py`` (its config), ``params.py`` (the parameter table, HF names)
and ``model.py`` (the bidirectional encoder forward the pooling runner calls)."""

from jaxllm.models.bert.config import BertConfig
from jaxllm.models.bert.model import encode
from jaxllm.models.bert.params import IGNORED_TENSORS, PARAMS

__all__ = ["BertConfig", "IGNORED_TENSORS", "PARAMS", "encode"]

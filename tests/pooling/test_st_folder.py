"""The pooler a sentence-transformers folder declares, and ``--pooler-config`` over it: read
from the files (both spellings of the pooling mode), refused by name where this runner would
otherwise pool the wrong way.  No model runs here."""

from __future__ import annotations

import json

import pytest

from jaxllm.errors import ModelLoadError
from jaxllm.pooling.config import PoolerConfig, PoolingEngineConfig
from jaxllm.pooling.st_folder import max_seq_length, read_pooler_config

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def _folder(tmp_path, modules, pooling: dict | None = None, bert_config: dict | None = None):
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if bert_config is not None:
        (tmp_path / "sentence_bert_config.json").write_text(json.dumps(bert_config))
    return str(tmp_path)


@pytest.mark.parametrize("pooling, expected", [
    ({"pooling_mode": "mean"}, "MEAN"),
    ({"pooling_mode": "cls"}, "CLS"),
    ({"pooling_mode": "lasttoken"}, "LAST"),
    # sentence-transformers before 5.x: one flag per mode
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "CLS"),
    ({"pooling_mode_mean_tokens": True}, "MEAN"),
])
def test_pooling_mode_is_read_in_both_spellings(tmp_path, pooling, expected):
    assert read_pooler_config(_folder(tmp_path, [TRANSFORMER, POOLING], pooling)) == PoolerConfig(expected, False)


def test_a_normalize_module_normalizes(tmp_path):
    path = _folder(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], {"pooling_mode": "cls"})
    assert read_pooler_config(path) == PoolerConfig("CLS", True)


def test_a_plain_hf_folder_has_no_pooler(tmp_path):
    assert read_pooler_config(str(tmp_path)) is None


@pytest.mark.parametrize("modules, pooling, match", [
    ([TRANSFORMER, POOLING], {"pooling_mode": "max"}, "pooling mode 'max' is not supported"),
    ([TRANSFORMER, POOLING], {"pooling_mode_max_tokens": True}, "pooling mode 'max' is not supported"),
    ([TRANSFORMER, POOLING], {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "exactly one"),
    ([TRANSFORMER, POOLING, {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
     {"pooling_mode": "mean"}, "module 'sentence_transformers.models.Dense' is not supported"),
    ([TRANSFORMER], None, "no Pooling module"),
])
def test_what_would_pool_wrongly_is_refused_by_name(tmp_path, modules, pooling, match):
    with pytest.raises(ModelLoadError, match=match):
        read_pooler_config(_folder(tmp_path, modules, pooling))


def test_max_seq_length(tmp_path):
    assert max_seq_length(_folder(tmp_path, [TRANSFORMER], bert_config={"max_seq_length": 48})) == 48


def test_pooler_config_overrides_the_checkpoint():
    base = PoolerConfig("MEAN", False)
    assert base.override({"pooling_type": "cls", "normalize": True}) == PoolerConfig("CLS", True)
    assert base.override({"normalize": True}) == PoolerConfig("MEAN", True)
    assert base.override(None) is base


@pytest.mark.parametrize("override, match", [
    ({"pooling_type": "MAX"}, "pooling_type must be one of CLS, MEAN, LAST"),
    ({"normalize": "yes"}, "normalize must be true or false"),
    ({"activation": True}, "unsupported key.*activation"),
    ({"dimensions": 0}, "dimensions must be a positive integer, got 0"),
])
def test_a_bad_pooler_config_is_a_value_error_naming_the_flag(override, match):
    with pytest.raises(ValueError, match=match):
        PoolingEngineConfig(model="m", pooler_config=override)

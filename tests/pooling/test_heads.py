"""The host-side heads of the pooling runner, without a model: Matryoshka support read as vLLM
reads it (and sentence-transformers' ``truncate_dim`` as the default size), vLLM's refusals of
``dimensions``, the cut-then-normalize order, and a classifier's probabilities and labels."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxllm.pooling.config import PoolerConfig
from jaxllm.pooling.heads import Matryoshka, class_probs, predicted_label, read_labels, truncate


def _folder(tmp_path, config: dict, st: dict | None = None) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if st is not None:
        (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(st))
    return str(tmp_path)


@pytest.mark.parametrize("config, st, expected", [
    ({}, None, Matryoshka()),
    ({"is_matryoshka": True}, None, Matryoshka(supported=True)),
    ({"matryoshka_dimensions": [8, 16]}, None, Matryoshka(supported=True, dimensions=(8, 16))),
    ({"is_matryoshka": False, "matryoshka_dimensions": None}, None, Matryoshka()),
    ({}, {"truncate_dim": 12}, Matryoshka(supported=True, default=12)),
    ({}, {"truncate_dim": None}, Matryoshka()),
])
def test_matryoshka_is_read_from_config_json_and_truncate_dim(tmp_path, config, st, expected):
    assert Matryoshka.read(_folder(tmp_path, config, st)) == expected


@pytest.mark.parametrize("m, dims, words", [
    (Matryoshka(), 8, 'Model "m" does not support matryoshka representation'),
    (Matryoshka(supported=True), 0, "dimensions must be greater than 0, got 0"),
    (Matryoshka(supported=True, dimensions=(8, 16)), 12, r'only supports \[8, 16\] matryoshka dimensions'),
    (Matryoshka(supported=True, dimensions=(8, 64)), 64, "dimensions 64 is more than the model's 32 dimensions"),
])
def test_dimensions_refusals(m, dims, words):
    with pytest.raises(ValueError, match=words):
        m.check(dims, 32, "m")


def test_allowed_dimensions_pass():
    Matryoshka().check(None, 32, "m")
    Matryoshka(supported=True).check(32, 32, "m")
    Matryoshka(supported=True, dimensions=(8, 16)).check(16, 32, "m")


def test_truncate_cuts_then_normalizes():
    v = np.array([3.0, 4.0, 12.0], np.float32)
    unit = v / np.linalg.norm(v)
    np.testing.assert_allclose(truncate(unit, 2, normalize=True), [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(truncate(v, 2, normalize=False), [3.0, 4.0])
    assert truncate(v, None, normalize=True) is v and truncate(v, 3, normalize=True) is v


def test_class_probs_softmax_and_one_label_sigmoid():
    np.testing.assert_allclose(class_probs(np.array([1.0, 2.0, 3.0])), np.exp([1, 2, 3]) / np.exp([1, 2, 3]).sum(),
                               rtol=1e-6)
    np.testing.assert_allclose(class_probs(np.array([0.5])), [1 / (1 + np.exp(-0.5))], rtol=1e-6)


def test_the_label_is_the_likeliest_class():
    assert predicted_label(np.array([0.2, 0.7, 0.1]), ["neg", "neu", "pos"]) == "neu"


def test_labels_come_from_id2label(tmp_path):
    assert read_labels(_folder(tmp_path, {"id2label": {"0": "neg", "1": "pos"}}), 2) == ["neg", "pos"]
    assert read_labels(str(tmp_path / "nowhere"), 2) == ["LABEL_0", "LABEL_1"]


def test_pooler_config_takes_dimensions():
    assert PoolerConfig().override({"dimensions": 8}).dimensions == 8
    with pytest.raises(ValueError, match="dimensions must be a positive integer, got 0"):
        PoolerConfig().override({"dimensions": 0})

"""XLM-RoBERTa / RoBERTa cross-encoders (bge-reranker's architecture) offline: ``LLM.score`` on a
tiny random ``XLMRobertaForSequenceClassification`` (one label) equals sentence-transformers'
``CrossEncoder.predict`` within 1e-4 and in the same order; a pair is the tokenizer's own
``<s> A </s></s> B </s>`` with no token types; a ``RobertaForSequenceClassification`` loads its
``RobertaClassificationHead`` into the same head.  (Offline only: the HTTP routes are the BERT
cross-encoder's, tests/serve/test_scoring.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import RobertaConfig, RobertaForSequenceClassification

from jaxllm import LLM
from jaxllm.models.loader import load_model
from support.tiny_encoders import cross_encoder_scores
from support.tiny_xlmr import build_xlmr_cross_encoder

QUERY = "the cat"
DOCS = ["the cat sat on the mat", "a dog ran fast", "sky", "blue river tree", "the big red house by the river"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = build_xlmr_cross_encoder(str(tmp_path_factory.mktemp("xlmr") / "cross"))
    return path, LLM(path, max_num_batched_tokens=64, max_num_seqs=8, strict_compile_guard=True)


def test_scores_match_the_cross_encoder_in_value_and_order(reranker):
    path, llm = reranker
    outs = llm.score(QUERY, DOCS)
    # The tokenizer's pair encoding: <s> query </s></s> document </s>, no token types.
    enc = llm.get_tokenizer()(QUERY, DOCS[0])
    assert "token_type_ids" not in enc
    assert outs[0].prompt_token_ids == enc["input_ids"]
    q = len(llm.get_tokenizer()(QUERY)["input_ids"])   # <s> query </s>
    assert enc["input_ids"][0] == 0 and enc["input_ids"][q - 1:q + 1] == [2, 2] and enc["input_ids"][-1] == 2
    got = np.array([o.outputs.score for o in outs])
    ref = cross_encoder_scores(path, [(QUERY, d) for d in DOCS])
    assert np.abs(got - ref).max() <= 1e-4
    assert list(np.argsort(-got)) == list(np.argsort(-ref))
    assert np.ptp(ref) > 0.05   # the documents really differ (the order test is not vacuous)


def test_a_roberta_classifier_loads_its_classification_head(tmp_path):
    torch.manual_seed(7)
    model = RobertaForSequenceClassification(RobertaConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=40, pad_token_id=1, num_labels=1))
    model.save_pretrained(str(tmp_path))
    loaded = load_model(str(tmp_path))
    assert loaded.arch.encoder.num_labels == 1 and loaded.arch.encoder.position_offset == 2
    head = model.classifier
    for ours, theirs in [("pooler", head.dense.weight), ("pooler_bias", head.dense.bias),
                         ("classifier", head.out_proj.weight), ("classifier_bias", head.out_proj.bias)]:
        np.testing.assert_array_equal(np.asarray(loaded.globals[ours], np.float32), theirs.detach().numpy())

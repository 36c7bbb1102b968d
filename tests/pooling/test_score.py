"""Cross-encoder scoring offline: ``LLM(path).score`` on a tiny random
``BertForSequenceClassification`` (one label) equals sentence-transformers' ``CrossEncoder.predict``
(the sigmoid of the logit, float32) within 1e-4 and in the same order, 1 -> N and N -> N; the
document is the pair's second text (token type 1).  ``LLM.classify`` / ``LLM.encode`` on a 3-label
classifier and on the one-label reranker give transformers' softmax / sigmoid probabilities (1e-5)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM
from support.tiny_encoders import build_bert_cross_encoder, classifier_probs, cross_encoder_scores

QUERY = "the cat"
DOCS = ["the cat sat on the mat", "a dog ran fast", "sky", "blue river tree", "the big red house by the river"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = build_bert_cross_encoder(str(tmp_path_factory.mktemp("cross") / "bert"))
    return path, LLM(path, max_num_batched_tokens=64, max_num_seqs=8, strict_compile_guard=True)


LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A 3-label head; one 16-token bucket (each text classifies in it)."""
    path = build_bert_cross_encoder(str(tmp_path_factory.mktemp("cls") / "bert"), seed=4, id2label=LABELS)
    return path, LLM(path, max_num_batched_tokens=16, max_num_seqs=4, strict_compile_guard=True)


def test_classify_matches_transformers_softmax(classifier):
    path, llm = classifier
    texts = DOCS[:3]
    want = classifier_probs(path, texts)
    outs = llm.classify(texts)
    got = np.array([o.outputs.probs for o in outs])
    assert got.shape == (3, 3) and [o.outputs.num_classes for o in outs] == [3, 3, 3]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode(texts[0]) and outs[0].finished
    assert llm.pooling_engine.labels == ["negative", "neutral", "positive"]
    np.testing.assert_allclose([o.outputs.data for o in llm.encode(texts)], want, rtol=0, atol=1e-5)


def test_a_one_label_head_classifies_by_its_sigmoid(reranker):
    path, llm = reranker
    want = classifier_probs(path, DOCS)
    np.testing.assert_allclose([o.outputs.probs for o in llm.classify(DOCS)], want, rtol=0, atol=1e-5)


def test_scores_match_the_cross_encoder_in_value_and_order(reranker):
    path, llm = reranker
    ref = cross_encoder_scores(path, [(QUERY, d) for d in DOCS])
    got = np.array([o.outputs.score for o in llm.score(QUERY, DOCS)])
    assert np.abs(got - ref).max() <= 1e-4
    assert list(np.argsort(-got)) == list(np.argsort(-ref))
    assert np.ptp(ref) > 0.05   # the documents really differ (the order test is not vacuous)


def test_pairwise_scores_and_swapped_texts(reranker):
    path, llm = reranker
    pairs = [(QUERY, DOCS[0]), (DOCS[0], QUERY)]
    ref = cross_encoder_scores(path, pairs)
    got = [o.outputs.score for o in llm.score([a for a, _ in pairs], [b for _, b in pairs])]
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)
    assert abs(got[0] - got[1]) > 1e-3   # token types: which text is second matters


def test_a_cross_encoder_does_not_embed_and_pairs_must_match(reranker):
    _, llm = reranker
    with pytest.raises(ValueError, match=r"is a cross-encoder: it scores .* classifies texts \(classify\(\)"):
        llm.embed(["the cat"])
    with pytest.raises(ValueError, match="pairs 2 first texts with 3 second texts"):
        llm.score(["a", "b"], ["c", "d", "e"])

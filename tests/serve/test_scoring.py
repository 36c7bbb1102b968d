"""``POST /score`` and ``/rerank`` (``/v1/rerank``, ``/v2/rerank``) on a pooling server (one shared
server on a tiny random BERT cross-encoder), over plain HTTP: scores equal
sentence-transformers' ``CrossEncoder.predict`` within 1e-4; ``/rerank`` sorts by them, with
``top_n`` and ``return_documents``; vLLM's two spellings of ``/score``; wrong uses are 400s
naming the field."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from jaxllm.config import ServingConfig
from jaxllm.pooling.async_engine import AsyncPoolingEngine
from jaxllm.pooling.config import PoolingEngineConfig
from jaxllm.pooling.engine import PoolingEngine
from support.serve_helpers import ServerThread, assert_error_shape
from support.pooling_metrics import counters
from support.tiny_encoders import build_bert_cross_encoder, classifier_probs, cross_encoder_scores

QUERY = "the cat"
DOCS = ["the cat sat on the mat", "a dog ran fast", "sky", "blue river tree", "the big red house by the river"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_bert_cross_encoder(str(tmp_path_factory.mktemp("cross") / "bert"))


@pytest.fixture(scope="module")
def base(folder):
    engine = AsyncPoolingEngine(PoolingEngine(PoolingEngineConfig(
        folder, max_num_batched_tokens=64, max_num_seqs=8, precompile="all", strict_compile_guard=True)))
    srv = ServerThread(engine, ServingConfig(port=0))
    yield srv.base
    srv.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(folder):
    return cross_encoder_scores(folder, [(QUERY, d) for d in DOCS])


@pytest.mark.parametrize("body", [{"text_1": QUERY, "text_2": DOCS}, {"queries": QUERY, "documents": DOCS}])
def test_score_matches_the_cross_encoder(base, reference, body):
    r = httpx.post(base + "/score", json=body).json()
    assert [d["index"] for d in r["data"]] == list(range(len(DOCS))) and r["object"] == "list"
    np.testing.assert_allclose([d["score"] for d in r["data"]], reference, rtol=0, atol=1e-4)
    assert r["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_sorts_by_relevance(base, reference, path):
    r = httpx.post(base + path, json={"query": QUERY, "documents": DOCS}).json()
    order = list(np.argsort(-reference))
    assert [x["index"] for x in r["results"]] == order
    assert [x["document"]["text"] for x in r["results"]] == [DOCS[i] for i in order]
    np.testing.assert_allclose([x["relevance_score"] for x in r["results"]], reference[order], rtol=0, atol=1e-4)
    top = httpx.post(base + path, json={"query": QUERY, "documents": DOCS, "top_n": 2,
                                        "return_documents": False}).json()["results"]
    assert [x["index"] for x in top] == order[:2] and all("document" not in x for x in top)


@pytest.mark.parametrize("path, body, param, words", [
    ("/rerank", {"query": QUERY, "documents": ["sky", "the " * 80]}, "documents", "documents[1] has"),
    ("/rerank", {"query": QUERY, "documents": []}, "documents", "must not be empty"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "pairs 2 first texts with 3"),
    ("/score", {"text_1": "a"}, "text_2", "send text_1 and text_2"),
    ("/v1/embeddings", {"input": "sky"}, "model", "is a cross-encoder"),
    ("/pooling", {"input": "sky", "dimensions": 8}, "dimensions", "does not support matryoshka representation"),
    ("/pooling", {"messages": [{"role": "user", "content": "sky"}]}, "messages", "has no chat template"),
    ("/classify", {"input": []}, "input", "must not be empty"),
])
def test_bad_requests_are_400s_naming_the_field(base, path, body, param, words):
    r = httpx.post(base + path, json=body)
    assert r.status_code == 400, r.text
    assert_error_shape(r.json(), 400, param)
    assert words in r.json()["error"]["message"]


def test_truncate_prompt_tokens_cuts_the_document(base):
    r = httpx.post(base + "/rerank", json={"query": QUERY, "documents": ["the " * 80], "truncate_prompt_tokens": 20})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 20


def test_classify_gives_the_sigmoid_of_the_one_logit(base, folder):
    r = httpx.post(base + "/classify", json={"input": DOCS}).json()
    assert r["id"].startswith("classify-") and r["object"] == "list"
    assert [(d["index"], d["label"], d["num_classes"]) for d in r["data"]] == [(i, "LABEL_0", 1) for i in range(5)]
    want = classifier_probs(folder, DOCS)
    np.testing.assert_allclose([d["probs"] for d in r["data"]], want, rtol=0, atol=1e-5)
    pooled = httpx.post(base + "/pooling", json={"input": DOCS[:2]}).json()
    np.testing.assert_allclose([d["data"] for d in pooled["data"]], want[:2], rtol=0, atol=1e-5)


def test_scoring_and_classifying_are_counted_in_metrics(base):
    """Each pooled prompt (a scored pair, a classified text) is a request finished with ``stop``."""
    stop, prompt = counters(base)
    tokens = 0
    for path, body in [("/score", {"text_1": QUERY, "text_2": DOCS[:2]}),
                       ("/rerank", {"query": QUERY, "documents": DOCS}),
                       ("/classify", {"input": DOCS[:3]}), ("/pooling", {"input": "sky"})]:
        r = httpx.post(base + path, json=body)
        assert r.status_code == 200, r.text
        tokens += r.json()["usage"]["prompt_tokens"]
    assert counters(base) == (stop + 2 + 5 + 3 + 1, prompt + tokens)

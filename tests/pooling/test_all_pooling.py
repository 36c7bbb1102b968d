"""``pooling_type`` ALL (vLLM's token embeddings): ``LLM.encode`` and ``POST /pooling`` answer every
prompt token's final hidden state, equal to transformers' ``last_hidden_state`` (float32) on a
tiny random BERT, also for prompts packed side by side in one step; normalize applies per token;
``embed``, ``/v1/embeddings`` and embedding scores refuse it (one vector per token is no embedding)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BertModel

from jaxllm import LLM
from jaxllm.config import ServingConfig
from jaxllm.pooling.async_engine import AsyncPoolingEngine
from jaxllm.pooling.config import PoolerConfig
from jaxllm.pooling.pool import pool
from support.serve_helpers import ServerThread, assert_error_shape
from support.tiny_encoders import build_bert_st

# Both fit one 32-token step: the second prompt's vectors come from the middle of the step's rows.
TEXTS = ["the cat sat on the mat", "a dog ran fast by the river"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_bert_st(str(tmp_path_factory.mktemp("bert_all") / "st"), "mean")


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, pooler_config={"pooling_type": "ALL"}, max_num_batched_tokens=32, max_num_seqs=4,
               strict_compile_guard=True)


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' last hidden state of each text alone, [n, D] float32 each."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = BertModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt")).last_hidden_state[0].numpy() for t in TEXTS]


def _close(got, ref):
    got = np.asarray(got, np.float32)
    assert got.shape == ref.shape
    cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert np.min(cos) >= 0.99999 and np.abs(got - ref).max() <= 1e-4


def test_encode_returns_every_tokens_hidden_state(llm, reference):
    outs = llm.encode(TEXTS, use_tqdm=False)
    assert [len(o.prompt_token_ids) for o in outs] == [len(r) for r in reference]
    for out, ref in zip(outs, reference):
        _close(out.outputs.data, ref)


def test_normalize_applies_per_token():
    hidden = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)          # [T, D]
    seq_ids, qsl = np.array([0, 0, 0, 1, 1, -1], np.int32), np.array([0, 3, 5], np.int32)
    out = np.asarray(pool(PoolerConfig("ALL", normalize=True), hidden, seq_ids, qsl))
    np.testing.assert_allclose(out, hidden / np.linalg.norm(hidden, axis=-1, keepdims=True), rtol=1e-6)


def test_embed_and_score_refuse_it(llm):
    with pytest.raises(ValueError, match="encode"):
        llm.embed("sky", use_tqdm=False)
    with pytest.raises(ValueError, match="encode"):
        llm.score("sky", ["the sun"])


def test_pooling_route_answers_token_vectors(llm, reference):
    engine = AsyncPoolingEngine(llm.pooling_engine)
    srv = ServerThread(engine, ServingConfig(port=0, served_model_names=("tiny-bert",)))
    try:
        r = httpx.post(srv.base + "/pooling", json={"input": TEXTS}, timeout=60)
        assert r.status_code == 200, r.text
        for item, ref in zip(r.json()["data"], reference):
            _close(item["data"], ref)
        bad = httpx.post(srv.base + "/v1/embeddings", json={"input": "sky"}, timeout=60)
        assert bad.status_code == 400
        assert_error_shape(bad.json(), 400, "model")
        assert "/pooling" in bad.json()["error"]["message"]
    finally:
        srv.stop()
        engine.shutdown()

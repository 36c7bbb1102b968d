"""``POST /v1/embeddings`` on a pooling server (one shared server on a tiny random BERT saved as
a sentence-transformers folder): the official ``openai`` client's ``embeddings.create`` (float and
base64) gets ``SentenceTransformer.encode``'s vectors; inputs as strings and token ids; a
too-long input, ``dimensions`` and a generation request are 400s naming what is wrong."""

from __future__ import annotations

import base64
import os
import sys

import httpx
import numpy as np
import openai
import pytest

from jaxllm.config import ServingConfig
from jaxllm.pooling.async_engine import AsyncPoolingEngine
from jaxllm.pooling.config import PoolingEngineConfig
from jaxllm.pooling.engine import PoolingEngine
from support.serve_helpers import ServerThread, assert_error_shape
from support.serve_process import running_server
from support.tiny_encoders import build_bert_st, st_encode

TEXTS = ["the cat sat on the mat", "a dog ran fast", "sky"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_bert_st(str(tmp_path_factory.mktemp("bert_st") / "mean"), "mean", normalize=True)


@pytest.fixture(scope="module")
def pooling_server(folder):
    # A server builds every bucket (16, 32, 64 tokens) before it takes a request.
    engine = AsyncPoolingEngine(PoolingEngine(PoolingEngineConfig(
        folder, max_num_batched_tokens=64, max_num_seqs=8, precompile="all", strict_compile_guard=True)))
    srv = ServerThread(engine, ServingConfig(port=0, served_model_names=("tiny-bert",)))
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(folder):
    return st_encode(folder, TEXTS)


def _close(got, ref):
    got = np.asarray(got, np.float32)
    cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert np.min(cos) >= 0.99999 and np.abs(got - ref).max() <= 1e-4


def _decoded(embedding):
    """An explicit ``base64`` answer comes back from the client as the string: little-endian float32."""
    return np.frombuffer(base64.b64decode(embedding), "<f4") if isinstance(embedding, str) else embedding


# None: the client asks for base64 itself and decodes it.
@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_openai_client_embeddings_match_sentence_transformers(pooling_server, reference, encoding_format):
    client = openai.OpenAI(base_url=pooling_server.base + "/v1", api_key="unused")
    kw = {} if encoding_format is None else {"encoding_format": encoding_format}
    r = client.embeddings.create(model="tiny-bert", input=TEXTS, **kw)
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "tiny-bert"
    assert isinstance(r.data[0].embedding, str) == (encoding_format == "base64")
    _close([_decoded(d.embedding) for d in r.data], reference)
    n = sum(len(client_ids) for client_ids in _ids(pooling_server, TEXTS))
    assert r.usage.prompt_tokens == r.usage.total_tokens == n


def _ids(server, texts):
    return [httpx.post(server.base + "/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]


def test_token_id_inputs(pooling_server, reference):
    ids = _ids(pooling_server, TEXTS)
    one = httpx.post(pooling_server.base + "/v1/embeddings", json={"input": ids[0]}).json()
    _close([one["data"][0]["embedding"]], reference[:1])
    many = httpx.post(pooling_server.base + "/v1/embeddings", json={"input": ids}).json()
    _close([d["embedding"] for d in many["data"]], reference)
    assert many["object"] == "list" and many["usage"]["prompt_tokens"] == sum(map(len, ids))


def test_truncate_prompt_tokens_keeps_the_last_tokens(pooling_server):
    ids = list(range(5, 100))
    cut = httpx.post(pooling_server.base + "/v1/embeddings", json={"input": ids, "truncate_prompt_tokens": 7}).json()
    last = httpx.post(pooling_server.base + "/v1/embeddings", json={"input": ids[-7:]}).json()
    assert cut["usage"]["prompt_tokens"] == 7 and cut["data"] == last["data"]


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/embeddings", {"input": "the " * 100}, "input", "more than the maximum of 64"),
    ("/v1/embeddings", {"input": [[5, 6], list(range(5, 100))]}, "input", "input[1] has 95 tokens"),
    ("/v1/embeddings", {"input": "sky", "dimensions": 8}, "dimensions", "Matryoshka"),
    ("/v1/embeddings", {"input": []}, "input", "must not be empty"),
    ("/v1/completions", {"prompt": "the", "max_tokens": 2}, "model", "use /v1/embeddings"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model", "use /v1/embeddings"),
    ("/v1/responses", {"input": "hi"}, "model", "use /v1/embeddings"),
])
def test_bad_requests_are_400s_naming_what_is_wrong(pooling_server, path, body, param, words):
    r = httpx.post(pooling_server.base + path, json=body)
    assert r.status_code == 400, r.text
    assert_error_shape(r.json(), 400, param)
    assert words in r.json()["error"]["message"]


def test_the_servers_other_routes_answer(pooling_server):
    """A pooling server still answers /v1/models, /health, /metrics and /tokenize."""
    base = pooling_server.base
    models = httpx.get(base + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-bert"] and models["data"][0]["max_model_len"] == 64
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/metrics").status_code == 200
    assert httpx.post(base + "/tokenize", json={"prompt": "sky"}).json()["count"] == 3   # [CLS] sky [SEP]


def test_jaxllm_serve_picks_the_pooling_runner_for_an_encoder(folder, reference, tmp_path):
    """The command line: no --runner (auto) on an encoder folder serves embeddings with its own
    pooler (MEAN + Normalize from modules.json); --pooler-config overrides it."""
    args = [sys.executable, "-m", "jaxllm.cli", "serve", folder, "--max-num-batched-tokens", "16", "--max-num-seqs", "4",
            "--pooler-config", '{"normalize": false}']
    with running_server(args, env=dict(os.environ), log=tmp_path / "serve.log", timeout=120, cwd=ROOT) as base:
        r = httpx.post(base + "/v1/embeddings", json={"input": TEXTS[2]}).json()
    got = np.asarray(r["data"][0]["embedding"], np.float32)
    assert abs(np.linalg.norm(got) - 1.0) > 1e-3   # the override took: not normalized
    _close([got / np.linalg.norm(got)], reference[2:3])

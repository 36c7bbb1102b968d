"""``POST /v1/embeddings`` and ``POST /pooling`` on a pooling server (one shared server on a tiny
random BERT saved as a sentence-transformers folder, declared Matryoshka, with a chat template):
the official ``openai`` client's ``embeddings.create`` (float and base64, and with
``dimensions``) gets ``SentenceTransformer.encode``'s vectors; inputs as strings, token ids and
chat ``messages``; the requests are counted in ``/metrics``; a too-long input, a bad
``dimensions``, ``input`` with ``messages``, ``/classify`` and a generation request are 400s
naming what is wrong."""

from __future__ import annotations

import base64
import logging
import os
import re
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
from support.pooling_metrics import counters
from support.tiny_encoders import build_bert_st, declare_matryoshka, st_encode, write_chat_template

TEXTS = ["the cat sat on the mat", "a dog ran fast", "sky"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Renders a conversation as BERT's own single-text input: "[CLS] content [SEP]" per message.
TEMPLATE = "{% for m in messages %}[CLS] {{ m['content'] }} [SEP]{% endfor %}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = build_bert_st(str(tmp_path_factory.mktemp("bert_st") / "mean"), "mean", normalize=True)
    return write_chat_template(declare_matryoshka(path), TEMPLATE)   # any size (no matryoshka_dimensions)


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
    ("/v1/embeddings", {"input": "sky", "dimensions": 0}, "dimensions", "dimensions must be greater than 0"),
    ("/v1/embeddings", {"input": "sky", "dimensions": 33}, "dimensions", "more than the model's 32 dimensions"),
    ("/v1/embeddings", {"input": []}, "input", "must not be empty"),
    ("/v1/embeddings", {"input": "sky", "messages": [{"role": "user", "content": "sky"}]}, "messages",
     "either input or messages, not both"),
    ("/v1/embeddings", {"model": "tiny-bert"}, "input", "send input (or messages)"),
    ("/pooling", {"input": "sky", "messages": [{"role": "user", "content": "sky"}]}, "messages", "not both"),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "the " * 70}]}, "messages",
     "messages has 72 tokens, more than the maximum of 64"),
    ("/classify", {"input": "sky"}, "model", "is an embedding model: it embeds texts"),
    ("/v1/completions", {"prompt": "the", "max_tokens": 2}, "model", "use /v1/embeddings"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model", "use /v1/embeddings"),
    ("/v1/responses", {"input": "hi"}, "model", "use /v1/embeddings"),
])
def test_bad_requests_are_400s_naming_what_is_wrong(pooling_server, path, body, param, words):
    r = httpx.post(pooling_server.base + path, json=body)
    assert r.status_code == 400, r.text
    assert_error_shape(r.json(), 400, param)
    assert words in r.json()["error"]["message"]


def test_openai_client_dimensions_match_sentence_transformers_truncate_dim(pooling_server, folder):
    """Matryoshka: the first 16 values, normalized after the cut (the folder's Normalize), as
    ``SentenceTransformer(truncate_dim=16).encode(normalize_embeddings=True)`` gives them."""
    client = openai.OpenAI(base_url=pooling_server.base + "/v1", api_key="unused")
    r = client.embeddings.create(model="tiny-bert", input=TEXTS, dimensions=16)
    got = np.array([d.embedding for d in r.data], np.float32)
    assert got.shape == (3, 16)
    _close(got, st_encode(folder, TEXTS, truncate_dim=16, normalize=True))
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_chat_messages_embed_as_the_rendered_text(pooling_server, reference):
    """vLLM's chat form: the template renders "[CLS] text [SEP]", tokenized without special tokens
    (vLLM's default for messages), so it embeds as the text itself does."""
    body = {"model": "tiny-bert", "messages": [{"role": "user", "content": TEXTS[0]}]}
    r = httpx.post(pooling_server.base + "/v1/embeddings", json=body).json()
    _close([r["data"][0]["embedding"]], reference[:1])
    assert r["usage"]["prompt_tokens"] == len(_ids(pooling_server, TEXTS[:1])[0])
    pooled = httpx.post(pooling_server.base + "/pooling", json=body).json()
    _close([pooled["data"][0]["data"]], reference[:1])


def test_add_special_tokens_false_leaves_cls_and_sep_out_of_input_text(pooling_server):
    r = httpx.post(pooling_server.base + "/v1/embeddings", json={"input": "sky", "add_special_tokens": False}).json()
    ids = _ids(pooling_server, ["sky"])[0][1:-1]   # [CLS] sky [SEP] -> sky
    assert r["usage"]["prompt_tokens"] == len(ids) == 1
    assert r["data"] == httpx.post(pooling_server.base + "/v1/embeddings", json={"input": ids}).json()["data"]


def test_pooling_answers_the_pooled_vectors_in_vllms_shape(pooling_server, reference):
    r = httpx.post(pooling_server.base + "/pooling", json={"model": "tiny-bert", "input": TEXTS}).json()
    assert r["id"].startswith("pool-") and r["object"] == "list" and r["model"] == "tiny-bert"
    assert [(d["index"], d["object"]) for d in r["data"]] == [(0, "pooling"), (1, "pooling"), (2, "pooling")]
    _close([d["data"] for d in r["data"]], reference)
    assert r["usage"]["prompt_tokens"] == sum(map(len, _ids(pooling_server, TEXTS)))
    b64 = httpx.post(pooling_server.base + "/pooling", json={"input": TEXTS[2], "encoding_format": "base64",
                                                             "dimensions": 8}).json()
    _close([_decoded(b64["data"][0]["data"])], reference[2:3, :8] / np.linalg.norm(reference[2, :8]))


def test_embedding_requests_are_counted_in_metrics(pooling_server):
    """vLLM counts each pooled prompt as a request finished with ``stop``, and its prompt tokens."""
    stop, prompt = counters(pooling_server.base)
    httpx.post(pooling_server.base + "/v1/embeddings", json={"input": TEXTS}).raise_for_status()
    httpx.post(pooling_server.base + "/pooling", json={"input": TEXTS[2]}).raise_for_status()
    assert httpx.post(pooling_server.base + "/v1/embeddings", json={"input": []}).status_code == 400   # not counted
    n = sum(map(len, _ids(pooling_server, TEXTS))) + len(_ids(pooling_server, TEXTS[2:])[0])
    assert counters(pooling_server.base) == (stop + 4, prompt + n)


def test_the_access_log_counts_pooling_requests(pooling_server, caplog):
    with caplog.at_level(logging.INFO, logger="jaxllm.serve"):
        httpx.post(pooling_server.base + "/pooling", json={"input": "sky"}).raise_for_status()
        assert httpx.post(pooling_server.base + "/classify", json={"input": "sky"}).status_code == 400
    lines = "\n".join(r.getMessage() for r in caplog.records if r.name == "jaxllm.serve")
    assert re.search(r'"POST /pooling" 200 prompt_tokens=3 output_tokens=0 [\d.]+s', lines), lines
    assert re.search(r'"POST /classify" 400 prompt_tokens=- output_tokens=- [\d.]+s', lines), lines


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

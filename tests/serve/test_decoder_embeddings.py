"""A decoder embedder served (one shared server on a tiny random Qwen3 saved as a
sentence-transformers folder, lasttoken + Normalize): the official ``openai`` client's
``embeddings.create`` gets ``SentenceTransformer.encode``'s vectors (its engine core schedules
asynchronously, the default, and compiled only its prefill buckets' steps: no sampler, no token
feed, no bucket under 16 tokens), a generation request is a 400 naming ``/v1/embeddings``; and
``jaxllm serve``'s ``--convert`` / ``--hf-overrides`` / ``--no-async-scheduling`` reach the
pooling engine's config (Qwen3-Reranker's command line)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest

from jaxllm import cli
from jaxllm.config import ServingConfig
from jaxllm.pooling.async_engine import AsyncPoolingEngine
from jaxllm.pooling.config import PoolingEngineConfig
from jaxllm.pooling.engine import PoolingEngine
from serve.cli import pooling_config_from_args
from support.serve_helpers import ServerThread, assert_error_shape
from support.tiny_decoders import RERANKER_OVERRIDES, build_qwen3_st, st_encode

TEXTS = ["the cat sat on the mat", "a dog ran fast", "sky"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm_tokenizer_dir):
    return build_qwen3_st(str(tmp_path_factory.mktemp("qwen3_st") / "st"), smollm_tokenizer_dir)


@pytest.fixture(scope="module")
def server(folder):
    # Buckets of 16 and 32 tokens, both built before the first request.
    engine = AsyncPoolingEngine(PoolingEngine(PoolingEngineConfig(
        folder, max_num_batched_tokens=32, max_num_seqs=4, precompile="all", strict_compile_guard=True)))
    srv = ServerThread(engine, ServingConfig(port=0, served_model_names=("tiny-qwen3-embed",)))
    yield srv
    srv.stop()
    engine.shutdown()


def test_openai_client_embeddings_match_sentence_transformers(server, folder):
    core = server.engine.engine.runner.core
    assert core.async_scheduling
    # Built at start-up: the steps of its prefill buckets only (none under 16 tokens), no sampler
    # program (a pooling step samples nothing), no async token feed (nothing is ever fed).
    compiler = core.runner.compiler
    assert sorted(compiler.steps) == [(16, 4), (32, 4)] and not compiler.samplers
    assert core.runner.token_feed is None
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused")
    r = client.embeddings.create(model="tiny-qwen3-embed", input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in r.data], np.float32)
    ref = st_encode(folder, TEXTS)
    cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert cos.min() >= 0.99999 and np.abs(got - ref).max() <= 1e-4


def test_a_generation_request_is_a_400_naming_the_embeddings_endpoint(server):
    r = httpx.post(server.base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400, r.text
    assert_error_shape(r.json(), 400, "model")
    assert "use /v1/embeddings" in r.json()["error"]["message"]


def test_convert_and_hf_overrides_flags_reach_the_pooling_config(folder):
    causal = folder + "_hf"   # a bare Qwen3ForCausalLM: generation unless --runner pooling
    parser = cli.build_parser()
    args = parser.parse_args(["serve", causal, "--runner", "pooling", "--hf-overrides", json.dumps(RERANKER_OVERRIDES),
                              "--attention-backend", "xla"])
    cfg = pooling_config_from_args(args)
    assert (cfg.convert, cfg.hf_overrides, cfg.attention_backend) == ("auto", RERANKER_OVERRIDES, "xla")
    assert pooling_config_from_args(parser.parse_args(["serve", causal])) is None
    embed = pooling_config_from_args(parser.parse_args(["serve", causal, "--runner", "pooling", "--convert", "embed"]))
    assert embed.convert == "embed" and embed.async_scheduling
    sync = pooling_config_from_args(parser.parse_args(["serve", causal, "--runner", "pooling", "--no-async-scheduling"]))
    assert not sync.async_scheduling
    with pytest.raises(ValueError, match="--hf-overrides is not valid JSON"):
        pooling_config_from_args(parser.parse_args(["serve", causal, "--hf-overrides", "{no"]))

"""ModernBERT under the pooling runner, offline, against transformers' eager attention (float32):
a tiny random ``ModernBertModel`` saved as a sentence-transformers folder (MEAN + Normalize) embeds
as ``SentenceTransformer.encode`` does, and a tiny ``ModernBertForSequenceClassification`` (mean
classifier pooling, every optional bias on) scores as ``CrossEncoder.predict`` and gives
transformers' logits.  Prompts are longer than the local window (4 tokens on either side), so the
local layer's mask and RoPE base matter; options the encoder does not implement are refused by
name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoConfig, ModernBertForMaskedLM

from jaxllm import LLM
from jaxllm.errors import ModelLoadError
from jaxllm.models.loader import load_model
from jaxllm.models.modernbert import ModernBertConfig
from jaxllm.pooling.config import PoolerConfig
from support.tiny_modernbert import (HALF_WINDOW, LAYER_TYPES, build_modernbert_classifier,
                                     build_modernbert_st, classifier_logits, cross_encoder_scores_eager,
                                     modernbert_config, st_encode_eager)

# One step of the 64-token bucket for each model (the only bucket either compiles).
ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=8, strict_compile_guard=True)
TEXTS = ["the cat sat on the mat and the dog ran fast to the big red house", "sky",
         "search rank embed model query document jax engine token vector is not slow",
         "a small green tree by the blue river"]
QUERY = "the cat"
DOCS = ["the cat sat on the mat by the big red house", "a dog ran fast", "sky",
        "blue river tree and the green sun", "the small house by the river is not big"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = build_modernbert_st(str(tmp_path_factory.mktemp("modernbert") / "st"))
    return path, LLM(path, **ENGINE)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = build_modernbert_classifier(str(tmp_path_factory.mktemp("modernbert") / "cls"))
    return path, LLM(path, **ENGINE)


def test_embeddings_match_sentence_transformers(embedder):
    path, llm = embedder
    assert llm.pooling_engine.pooler == PoolerConfig("MEAN", normalize=True)
    arch = llm.pooling_engine.arch
    assert arch.layer_types == tuple(LAYER_TYPES) and arch.encoder.half_window == HALF_WINDOW
    outs = llm.embed(TEXTS)
    assert max(len(o.prompt_token_ids) for o in outs) > 2 * HALF_WINDOW + 1   # the window cuts some pairs
    got = np.array([o.outputs.embedding for o in outs], np.float32)
    ref = st_encode_eager(path, TEXTS)
    assert got.shape == ref.shape == (len(TEXTS), 32)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999, cos
    assert np.abs(got - ref).max() <= 1e-4


def test_cross_encoder_scores_and_logits_match_transformers(reranker):
    path, llm = reranker
    pairs = [(QUERY, d) for d in DOCS]
    got = np.array([o.outputs.score for o in llm.score(QUERY, DOCS)])
    ref = cross_encoder_scores_eager(path, pairs)
    assert np.abs(got - ref).max() <= 1e-4
    assert list(np.argsort(-got)) == list(np.argsort(-ref))
    assert np.ptp(ref) > 0.05   # the documents really differ (the order test is not vacuous)
    # The raw logits, before the sigmoid flattens them.
    engine = llm.pooling_engine
    tok = [engine.tokenize_pair(a, b) for a, b in pairs]
    assert "token_type_ids" not in engine.tokenizer(QUERY, DOCS[0])   # ModernBERT has no token types
    logits = np.array(engine.embed_ids([ids for ids, _ in tok], [types for _, types in tok]))
    np.testing.assert_allclose(logits, classifier_logits(path, pairs), rtol=0, atol=1e-4)


@pytest.mark.parametrize("change, message", [
    (dict(hidden_activation="silu"), "hidden_activation 'silu' is not supported for ModernBertModel"),
    (dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "rope_parameters\\['full_attention'\\] rope_type 'linear' is not supported"),
])
def test_unimplemented_options_are_refused_by_name(change, message):
    with pytest.raises(ModelLoadError, match=message):
        ModernBertConfig.from_hf(modernbert_config(**change), "ModernBertModel", "config.json")


def test_a_masked_lm_checkpoint_loads_as_an_embedder(tmp_path):
    """``ModernBertForMaskedLM``'s names (under ``model.``; its head skipped): the fused ``Wqkv``
    and ``Wi`` split in transformers' order (q, k, v; the activated input, then the gate), and
    layer 0 without an attention norm."""
    torch.manual_seed(8)
    model = ModernBertForMaskedLM(modernbert_config())
    model.save_pretrained(str(tmp_path))
    loaded = load_model(str(tmp_path))
    assert loaded.arch.encoder.num_labels == 0 and loaded.arch.encoder.local_rope_theta == 50.0
    assert "attn_norm" not in loaded.layers[0] and "attn_norm" in loaded.layers[1]
    layer = model.model.layers[1]
    D, F = 32, 48
    wqkv, wi = layer.attn.Wqkv.weight.detach().numpy(), layer.mlp.Wi.weight.detach().numpy()
    for name, want in [("q", wqkv[:D]), ("k", wqkv[D:2 * D]), ("v", wqkv[2 * D:]), ("up", wi[:F]), ("gate", wi[F:])]:
        np.testing.assert_array_equal(np.asarray(loaded.layers[1][name], np.float32), want, err_msg=name)


def test_a_hub_style_config_reads_its_layer_pattern_and_rope_bases(tmp_path):
    """The config.json the Hub's ModernBERT checkpoints carry (transformers 4.x keys:
    ``global_attn_every_n_layers``, ``global_rope_theta`` / ``local_rope_theta``), as
    gte-reranker-modernbert-base has it (mean classifier pooling)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["ModernBertForSequenceClassification"], "model_type": "modernbert", "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 7, "num_attention_heads": 4, "global_attn_every_n_layers": 3,
        "global_rope_theta": 160000.0, "local_rope_theta": 10000.0, "local_attention": 128,
        "classifier_pooling": "mean", "vocab_size": 100, "id2label": {"0": "LABEL_0"}}))
    arch = ModernBertConfig.from_hf(AutoConfig.from_pretrained(str(tmp_path)), "ModernBertForSequenceClassification",
                                    "config.json")
    glob, loc = "full_attention", "sliding_attention"
    assert arch.layer_types == (glob, loc, loc, glob, loc, loc, glob)
    assert (arch.rope_theta, arch.encoder.local_rope_theta, arch.encoder.half_window) == (160000.0, 10000.0, 64)
    assert (arch.encoder.num_labels, arch.encoder.classifier_pooling) == (1, "mean")

"""Causal decoders under the pooling runner (vLLM's ``--convert embed|classify``), against their
oracles on tiny random Qwen3 checkpoints:

- a sentence-transformers folder over a Qwen3 (Pooling lasttoken + Normalize, a ``query``
  instruction prompt declared) converts by itself (``runner="auto"``) and embeds as
  ``SentenceTransformer.encode`` on the same texts (the declared prompts are not applied, as
  vLLM), on the native CPU kernels; the bare causal LM under ``runner="pooling",
  convert="embed"`` (vLLM's default LAST + normalize) does too on the XLA kernels;
- a mixed-length batch equals each input alone;
- a ``Qwen3ForSequenceClassification`` scores as the sigmoid of transformers' logit;
- a Qwen3-Reranker-style causal LM under vLLM's ``hf_overrides`` (``classifier_from_token``
  no/yes) scores as the softmax of its "no"/"yes" logits at the last token (p(yes));
- prompts longer than a step (``max_num_batched_tokens``) are chunked through the generation
  engine's scheduler and compiled buckets: LAST (vs sentence-transformers) and MEAN (the sum
  carried across chunks, vs transformers' hidden states), a mixed batch equal to each alone,
  the KV pool full again after, no compile once the buckets ran; the LAST and MEAN engines of
  one model and buckets look up different programs in the shared program cache (a stale
  program of the other pooling type is never loaded); async scheduling (the default: a prompt's
  next chunk dispatched before its last one is applied) gives the rows of synchronous scheduling;
- ``pooling_type`` ALL (one row per token) and CLS (a first token that sees nothing after it) are
  refused for a converted decoder at start-up, by name.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from jaxllm import LLM
from jaxllm.runner import compile as cc
from jaxllm.runner.program_cache import ProgramCache
from support.tiny_decoders import (RERANKER_OVERRIDES, build_qwen3_classifier, build_qwen3_st, classifier_scores,
                                   mean_hidden, rerank_document, rerank_query, st_encode, yes_no_scores)
from support.tiny_models import build_tiny

ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=8, strict_compile_guard=True)
TEXTS = ["the cat sat on the mat", "a dog", "search rank embed model query document jax engine token vector",
         "sky", "the big red house by the river is not small, and the green tree is tall!"]
QUERY = "the cat"
DOCS = ["the cat sat on the mat", "a dog ran fast", "sky", "blue river tree"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm_tokenizer_dir):
    root = tmp_path_factory.mktemp("decoders")
    st = build_qwen3_st(str(root / "st"), smollm_tokenizer_dir)
    return {"st": st, "causal": st + "_hf",   # the same weights as a bare Qwen3ForCausalLM
            "classifier": build_qwen3_classifier(str(root / "cls"), smollm_tokenizer_dir),
            "reranker": build_tiny("qwen3_qk_norm", str(root / "reranker"), smollm_tokenizer_dir, seed=5)}


@pytest.fixture(scope="module")
def embedders(folders):
    return {"native": LLM(folders["st"], attention_backend="native", **ENGINE),
            "xla": LLM(folders["causal"], runner="pooling", convert="embed", attention_backend="xla", **ENGINE)}


def _vectors(outs) -> np.ndarray:
    return np.array([o.outputs.embedding for o in outs], np.float32)


@pytest.mark.parametrize("path", ["native", "xla"])
def test_embeddings_match_sentence_transformers(folders, embedders, path):
    llm = embedders[path]
    engine = llm.pooling_engine
    assert (engine.pooler.pooling_type, engine.pooler.normalize) == ("LAST", True)
    assert engine.runner.kernels.attention == path
    assert engine.runner.core.async_scheduling   # the default: step N+1 dispatched while N runs
    outs = llm.embed(TEXTS)
    tok = llm.get_tokenizer()
    # The folder's "query" prompt is not applied: the text's own tokens (vLLM leaves prompts to the caller).
    assert outs[0].prompt_token_ids == tok.encode(TEXTS[0])
    got, ref = _vectors(outs), st_encode(folders["st"], TEXTS)
    assert got.shape == ref.shape == (len(TEXTS), 64)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999, cos
    assert np.abs(got - ref).max() <= 1e-4


def test_a_mixed_batch_equals_each_input_alone(embedders):
    llm = embedders["native"]
    batch = _vectors(llm.embed(TEXTS))
    alone = np.concatenate([_vectors(llm.embed([t])) for t in TEXTS])
    np.testing.assert_allclose(batch, alone, rtol=0, atol=1e-6)


def test_sequence_classification_scores_match_transformers(folders):
    llm = LLM(folders["classifier"], **ENGINE)   # runner="auto": a *ForSequenceClassification converts itself
    assert llm.pooling_engine.num_labels == 1
    got = np.array([o.outputs.score for o in llm.score(QUERY, DOCS)])
    ref = classifier_scores(folders["classifier"], [(QUERY, d) for d in DOCS])
    assert np.abs(got - ref).max() <= 1e-4
    assert list(np.argsort(-got)) == list(np.argsort(-ref)) and np.ptp(ref) > 0.05
    with pytest.raises(ValueError, match="is a cross-encoder: it scores text pairs"):
        llm.embed(["the cat"])


def test_qwen3_reranker_scores_are_the_yes_no_softmax(folders):
    llm = LLM(folders["reranker"], runner="pooling", hf_overrides=RERANKER_OVERRIDES,
              **{**ENGINE, "max_num_batched_tokens": 256})
    query, docs = rerank_query(QUERY), [rerank_document(d) for d in DOCS]
    outs = llm.score(query, docs)
    got = np.array([o.outputs.score for o in outs])
    ref = yes_no_scores(folders["reranker"], [(query, d) for d in docs])
    assert np.abs(got - ref).max() <= 1e-4
    assert list(np.argsort(-got)) == list(np.argsort(-ref)) and np.ptp(ref) > 1e-3
    # vLLM's rule for an LLM as a reranker: the pair is one text, query + document (a word split
    # across the two is one token, not two as the tokenizer's pair encoding would give).
    tok = llm.get_tokenizer()
    assert outs[0].prompt_token_ids == tok(query + docs[0])["input_ids"]
    (joined,) = llm.score("the ca", "t sat")
    assert joined.prompt_token_ids == tok("the cat sat")["input_ids"] != tok("the ca", "t sat")["input_ids"]


def test_refusals_name_what_to_use(folders):
    with pytest.raises(ValueError, match="has no score.weight .* and no classifier_from_token"):
        LLM(folders["reranker"], runner="pooling", convert="classify", **ENGINE)
    with pytest.raises(ValueError, match="is a classifier .*runner='pooling'"):
        LLM(folders["classifier"], runner="generate")
    with pytest.raises(ValueError, match=r"convert='embed' \(--convert\) needs runner='pooling'"):
        LLM(folders["causal"], runner="generate", convert="embed")
    with pytest.raises(ValueError, match=r"hf_overrides \(--hf-overrides\) applies to the pooling runner only"):
        LLM(folders["causal"], hf_overrides={"max_position_embeddings": 64})
    with pytest.raises(ValueError, match="classifier_from_token needs method"):
        LLM(folders["reranker"], runner="pooling", convert="classify",
            hf_overrides={"classifier_from_token": ["no", "yes"]}, **ENGINE)
    with pytest.raises(ValueError, match="pooling_type ALL is served for encoders; a converted decoder"):
        LLM(folders["causal"], runner="pooling", convert="embed", pooler_config={"pooling_type": "ALL"}, **ENGINE)
    with pytest.raises(ValueError, match=r"pooling_type CLS is not for a causal decoder .*use LAST or MEAN"):
        LLM(folders["causal"], runner="pooling", convert="embed", pooler_config={"pooling_type": "CLS"}, **ENGINE)
    assert os.path.isfile(os.path.join(folders["st"], "modules.json"))


def _close(got: np.ndarray, ref: np.ndarray) -> None:
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999, cos
    assert np.abs(got - ref).max() <= 1e-4


def test_prompts_longer_than_a_step_are_chunked_through_the_scheduler(folders, monkeypatch):
    small = dict(max_num_batched_tokens=16, max_num_seqs=2, strict_compile_guard=True)
    # Each step program looked up in the program cache: its bucket -> its key.  Whether a saved
    # program exists depends on earlier runs (a JAX persistent-cache hit is not saved), so the
    # keys are checked rather than trusting a stale load to show up in the vectors.
    keyed: dict[str, str] = {}
    key = ProgramCache.key

    def recording(self, description: str) -> str:
        k = key(self, description)
        if description.startswith("step|"):
            keyed[re.search(r"\|T=\d+\|S=\d+\|", description).group()] = k
        return k

    monkeypatch.setattr(ProgramCache, "key", recording)
    long_text = " ".join(TEXTS)
    texts = [long_text, "a dog", TEXTS[4]]
    # The bare causal LM (vLLM's default LAST + normalize) = the sentence-transformers folder over it; the
    # MEAN engine below has the same model and buckets: its programs must not be taken for these.
    last = LLM(folders["causal"], runner="pooling", convert="embed", **small)
    outs = last.embed(texts)
    assert len(outs[0].prompt_token_ids) > 2 * 16 and len(outs[2].prompt_token_ids) > 16   # three chunks, two
    _close(_vectors(outs), st_encode(folders["st"], texts))
    last_keys = dict(keyed)
    keyed.clear()

    mean = LLM(folders["causal"], runner="pooling", convert="embed",
               pooler_config={"pooling_type": "MEAN", "normalize": False}, **small)
    core = mean.pooling_engine.runner.core
    ids = [o.prompt_token_ids for o in outs]
    batch = _vectors(mean.embed(ids))
    _close(batch, mean_hidden(folders["causal"], ids))
    # The same buckets ran, under other keys: the MEAN engine never loads the LAST engine's programs.
    assert last_keys and set(keyed) == set(last_keys)
    assert all(keyed[b] != last_keys[b] for b in keyed), (keyed, last_keys)
    # Chunks of one prompt beside other prompts' in a step: each row as when it runs alone.
    alone = np.concatenate([_vectors(mean.embed([p])) for p in ids])
    np.testing.assert_allclose(batch, alone, rtol=0, atol=1e-5)
    # Every block back in the pool (pooling requests keep none, fill no prefix cache) ...
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks and not core.has_unfinished_requests()
    # ... and the buckets that ran run again without tracing or compiling.
    before = cc.counts()
    np.testing.assert_allclose(_vectors(mean.embed(ids)), batch, rtol=0, atol=0)
    after = cc.counts()
    assert (after["traces"], after["compiles"]) == (before["traces"], before["compiles"])
    # Async scheduling (the default) runs a prompt's next chunk before its last one is applied:
    # the same rows as one step at a time (the same programs, from the program cache).
    sync = LLM(folders["causal"], runner="pooling", convert="embed", async_scheduling=False,
               pooler_config={"pooling_type": "MEAN", "normalize": False}, **small)
    assert core.async_scheduling and not sync.pooling_engine.runner.core.async_scheduling
    np.testing.assert_allclose(_vectors(sync.embed(ids)), batch, rtol=0, atol=1e-6)

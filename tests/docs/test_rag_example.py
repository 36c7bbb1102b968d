"""The README's RAG example (embed, rerank, chat), run as written but small: its two placeholder
paths become a tiny random BERT embedder (a sentence-transformers folder, MEAN + Normalize) and a
tiny random BERT cross-encoder built here, and ``LLM()`` the suite's shared built-in model
(``builtin_llm``: the same model, small buckets).  The block's code is otherwise unchanged.

Random weights rank the passages arbitrarily, so what is checked is that the block's choices are
the oracles': the candidates are the top two by sentence-transformers' cosine, ``best`` the
candidate ``CrossEncoder.predict`` scores highest, the printed line says so, and the answer is
the chat model's reply to the rendered prompt holding that passage.  (The README block is
``skip``-annotated for tests/docs/test_snippets.py, which cannot build checkpoints; its reason
names this file.)"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

from support.snippets import all_blocks
from support.tiny_encoders import build_bert_cross_encoder, build_bert_st, cross_encoder_scores, st_encode

EMBEDDER, RERANKER, CHAT = '"/path/to/bge-small"', '"/path/to/bge-reranker-base"', "chat = LLM()"


@pytest.fixture(scope="module")
def block():
    (b,) = [b for b in all_blocks() if b.path == "README.md" and "reranker.score(" in b.body]
    assert b.lang == "python" and b.kind == "skip" and "test_rag_example.py" in b.attrs["reason"], b.where
    for old in (EMBEDDER, RERANKER, CHAT):
        assert old in b.body, (b.where, old)
    return b


@pytest.fixture(scope="module")
def ran(block, tmp_path_factory, builtin_llm):
    root = tmp_path_factory.mktemp("rag")
    embedder = build_bert_st(str(root / "embedder"), "mean", normalize=True, seed=4)
    reranker = build_bert_cross_encoder(str(root / "reranker"), seed=5)
    code = (block.body.replace(EMBEDDER, repr(embedder)).replace(RERANKER, repr(reranker))
            .replace(CHAT, "chat = builtin_llm"))
    ns: dict = {"builtin_llm": builtin_llm}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, block.where, "exec"), ns)   # noqa: S102
    return ns, out.getvalue().splitlines(), embedder, reranker


def test_readme_rag_example_picks_what_the_oracles_pick(ran, block):
    ns, printed, embedder, reranker = ran
    docs, query = ns["docs"], ns["query"]
    vecs = st_encode(embedder, [query, *docs])                       # normalized: dot = cosine
    top2 = [int(i) for i in np.argsort(-(vecs[1:] @ vecs[0]))[:2]]
    assert ns["candidates"] == top2
    scores = cross_encoder_scores(reranker, [(query, docs[i]) for i in top2])
    np.testing.assert_allclose(ns["scores"], scores, atol=1e-4)
    assert ns["best"] == docs[top2[int(np.argmax(scores))]]
    assert printed[0] == f"candidates: {top2} best: {ns['best']}"
    print(f"{block.where}: {printed[0]}")


def test_readme_rag_example_answers_from_the_best_passage(ran, builtin_llm):
    ns, printed, _, _ = ran
    reply = ns["reply"][0]
    # The chat template rendered the prompt holding the chosen passage; the answer printed is the reply.
    assert ns["best"] in builtin_llm.get_tokenizer().decode(reply.prompt_token_ids)
    text = reply.outputs[0].text
    assert text.strip() and printed[1:] == text.splitlines()
    print(f"answer: {text!r}")

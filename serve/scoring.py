"""``POST /score`` and ``POST /rerank`` (also ``/v1/rerank``, ``/v2/rerank``) on a pooling server.

A cross-encoder (``*ForSequenceClassification``) scores each (query, document) pair: the sigmoid
of its one logit; an embedder scores by the cosine similarity of the two embeddings (vLLM's
rule).  ``/score`` pairs one first text with N second texts, or N with N; ``/rerank`` scores one
query against its documents and returns them sorted by relevance (``top_n``,
``return_documents``).  A bad or too-long pair is a 400 naming the field.
"""

from __future__ import annotations

import time
import uuid

from jaxllm.pooling.async_engine import AsyncPoolingEngine
from jaxllm.pooling.engine import cosine, score_pairs
from serve.protocol import RerankRequest, ScoreRequest, bad_request
from serve.state import ServerState


async def _scores(engine: AsyncPoolingEngine, pairs: list[tuple], truncate: int | None, field: str):
    """(scores, prompt tokens) for the pairs; ValueErrors become 400s naming ``field``."""
    core = engine.engine
    if not core.cross_encoder:
        try:
            core.check_embedder()   # an embedder scores by cosine: not with ALL pooling's token vectors
        except ValueError as e:
            raise bad_request(str(e), "model") from None
    try:
        if core.cross_encoder:
            tok = [engine.tokenize_pair(a, b, truncate, where=f"{field}[{i}]") for i, (a, b) in enumerate(pairs)]
        else:
            texts = [t for pair in pairs for t in pair]
            ids = [engine.tokenize(t, truncate, index=i) for i, t in enumerate(texts)]
    except ValueError as e:
        raise bad_request(str(e), field) from None
    if core.cross_encoder:
        rows = await engine.embed_ids([t[0] for t in tok], [t[1] for t in tok])
        return core.pair_scores(rows), sum(len(t[0]) for t in tok)
    vecs = await engine.embed_ids(ids)
    return [cosine(vecs[2 * i], vecs[2 * i + 1]) for i in range(len(pairs))], sum(map(len, ids))


async def create_score(state: ServerState, engine: AsyncPoolingEngine, req: ScoreRequest) -> dict:
    state.check_model(req.model)
    first = req.text_1 if req.text_1 is not None else req.queries
    second = req.text_2 if req.text_2 is not None else req.documents
    if first is None or second is None:
        raise bad_request("send text_1 and text_2 (or queries and documents)", "text_1" if first is None else "text_2")
    try:
        pairs = score_pairs(first, second)
    except ValueError as e:
        raise bad_request(str(e), "text_2") from None
    scores, n = await _scores(engine, pairs, req.truncate_prompt_tokens, "text_2")
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": state.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}}


async def create_rerank(state: ServerState, engine: AsyncPoolingEngine, req: RerankRequest) -> dict:
    state.check_model(req.model)
    if not req.documents:
        raise bad_request("documents must not be empty", "documents")
    scores, n = await _scores(engine, [(req.query, d) for d in req.documents], req.truncate_prompt_tokens,
                              "documents")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])   # stable: ties keep the documents' order
    if req.top_n:
        order = order[:req.top_n]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": req.documents[i]}} if req.return_documents else {})} for i in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": state.model_name, "results": results,
            "usage": {"prompt_tokens": n, "total_tokens": n}}

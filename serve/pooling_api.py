"""``POST /pooling`` and ``POST /classify`` on a pooling server (vLLM's shapes), and what every
pooling route shares: a request's prompts as checked token ids, from ``input`` or from chat
``messages`` (rendered by the one chat renderer, serve/chat.py), and a vector's encoding.

``/pooling`` answers the pooler's raw output (an embedder's embedding, ``dimensions`` honoured;
a classifier's probabilities); ``/classify`` a classifier's probabilities with the label of the
likeliest class (``id2label``).  An embedder asked to classify is a 400 naming ``/v1/embeddings``.
"""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np

from jaxllm.engine.tokenizer import encode
from jaxllm.pooling.async_engine import AsyncPoolingEngine
from jaxllm.pooling.heads import class_probs, predicted_label
from serve import chat
from serve.protocol import ClassifyRequest, EmbeddingRequest, PoolingRequest, bad_request
from serve.state import ServerState


def _inputs(inp) -> list:
    if isinstance(inp, str):
        return [inp]
    if not inp:
        raise bad_request("input must not be empty", "input")
    if isinstance(inp[0], int):
        return [inp]
    return list(inp)


def _check_truncate(truncate: int | None) -> None:
    if truncate is not None and (truncate == 0 or truncate < -1):
        raise bad_request(f"truncate_prompt_tokens must be -1 or at least 1, got {truncate}", "truncate_prompt_tokens")


def request_prompts(state: ServerState, engine: AsyncPoolingEngine, req) -> list[list[int]]:
    """``input`` (or, on an embeddings / pooling request, ``messages``) -> checked token ids, one
    list per prompt; every prompt is checked before any runs (a 400 naming the field)."""
    truncate = req.truncate_prompt_tokens
    _check_truncate(truncate)
    messages = getattr(req, "messages", None)
    if messages is not None and req.input is not None:
        raise bad_request("send either input or messages, not both", "messages")
    if messages is not None:
        if not messages:
            raise bad_request("messages must not be empty", "messages")
        _, ids = chat.render_messages(
            state, messages, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs, tools=None, add_special_tokens=bool(req.add_special_tokens))
        try:
            return [engine.tokenize(ids, truncate)]
        except ValueError as e:
            raise bad_request(str(e).replace("input", "messages", 1), "messages") from None
    if req.input is None:
        raise bad_request("send input (or messages)" if isinstance(req, EmbeddingRequest) else "send input", "input")
    prompts = _inputs(req.input)
    if getattr(req, "add_special_tokens", None) is False and engine.tokenizer is not None:   # text without them
        prompts = [encode(engine.tokenizer, p, add_special_tokens=False) if isinstance(p, str) else p for p in prompts]
    try:
        return [engine.tokenize(p, truncate, index=None if len(prompts) == 1 else i) for i, p in enumerate(prompts)]
    except ValueError as e:
        raise bad_request(str(e), "input") from None


def output_dimensions(state: ServerState, engine: AsyncPoolingEngine, dimensions: int | None) -> int | None:
    """The embedding size a request gets (a 400 naming ``dimensions`` when the model refuses it)."""
    try:
        return engine.engine.output_dimensions(dimensions, state.model_name)
    except ValueError as e:
        raise bad_request(str(e), "dimensions") from None


def encode_vector(vec: np.ndarray, fmt: str):
    """``float``: a JSON list; ``base64``: little-endian float32 bytes (the ``openai`` client's default)."""
    if fmt == "base64":
        return base64.b64encode(np.asarray(vec, "<f4").tobytes()).decode("ascii")
    return np.asarray(vec).tolist()


def usage(ids: list[list[int]]) -> dict:
    n = sum(len(p) for p in ids)
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}


async def create_pooling(state: ServerState, engine: AsyncPoolingEngine, req: PoolingRequest) -> dict:
    state.check_model(req.model)
    core = engine.engine
    dims = output_dimensions(state, engine, req.dimensions)
    ids = request_prompts(state, engine, req)
    rows = await engine.embed_ids(ids)
    data = [encode_vector(core.pooled_data(r, dims), req.encoding_format) for r in rows]
    return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": state.model_name,
            "data": [{"index": i, "object": "pooling", "data": d} for i, d in enumerate(data)],
            "usage": usage(ids)}


async def create_classify(state: ServerState, engine: AsyncPoolingEngine, req: ClassifyRequest) -> dict:
    state.check_model(req.model)
    core = engine.engine
    try:
        core.check_classifier()
    except ValueError as e:
        raise bad_request(f"{e}; use /v1/embeddings", "model") from None
    ids = request_prompts(state, engine, req)
    rows = await engine.embed_ids(ids)
    data = []
    for i, r in enumerate(rows):
        probs = class_probs(r)
        data.append({"index": i, "label": predicted_label(probs, core.labels), "probs": probs.tolist(),
                     "num_classes": len(probs)})
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": state.model_name, "data": data, "usage": usage(ids)}

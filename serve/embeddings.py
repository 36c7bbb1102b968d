"""``POST /v1/embeddings`` (OpenAI's shape, vLLM's extras) on a pooling server.

``input``: a string, a list of strings, a list of token ids, or a list of token-id lists;
``encoding_format``: ``float`` or ``base64`` (little-endian float32, what the ``openai`` client
asks for by default); ``truncate_prompt_tokens``: keep a prompt's last k tokens (-1: as many as
the model takes); ``dimensions``: a 400 naming it (no Matryoshka model is served yet).  Every
input is checked before any runs: a bad or too-long one is a 400 naming ``input``.
"""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np

from jaxllm.pooling.async_engine import AsyncPoolingEngine
from serve.protocol import EmbeddingRequest, bad_request
from serve.state import ServerState


def _inputs(req: EmbeddingRequest) -> list:
    inp = req.input
    if isinstance(inp, str):
        return [inp]
    if not inp:
        raise bad_request("input must not be empty", "input")
    if isinstance(inp[0], int):
        return [inp]
    return list(inp)


def _encode(vec: np.ndarray, fmt: str):
    if fmt == "base64":
        return base64.b64encode(np.asarray(vec, "<f4").tobytes()).decode("ascii")
    return vec.tolist()


async def create_embedding(state: ServerState, engine: AsyncPoolingEngine, req: EmbeddingRequest) -> dict:
    state.check_model(req.model)
    try:
        engine.engine.check_embedder()
    except ValueError as e:
        raise bad_request(str(e), "model") from None
    if req.dimensions is not None:
        raise bad_request(f"dimensions is not supported by {state.model_name}: the model has no Matryoshka "
                          f"representation (its vectors have {engine.engine.hidden_size} dimensions)", "dimensions")
    truncate = req.truncate_prompt_tokens
    if truncate is not None and (truncate == 0 or truncate < -1):
        raise bad_request(f"truncate_prompt_tokens must be -1 or at least 1, got {truncate}", "truncate_prompt_tokens")
    prompts = _inputs(req)
    try:
        ids = [engine.tokenize(p, truncate, index=None if len(prompts) == 1 else i) for i, p in enumerate(prompts)]
    except ValueError as e:
        raise bad_request(str(e), "input") from None
    vecs = await engine.embed_ids(ids)
    n = sum(len(p) for p in ids)
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": state.model_name,
            "data": [{"index": i, "object": "embedding", "embedding": _encode(v, req.encoding_format)}
                     for i, v in enumerate(vecs)],
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}}

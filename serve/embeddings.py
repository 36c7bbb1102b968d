"""``POST /v1/embeddings`` (OpenAI's shape, vLLM's extras) on a pooling server.

``input``: a string, a list of strings, a list of token ids, or a list of token-id lists; or
vLLM's chat form, ``messages`` (with ``chat_template``, ``chat_template_kwargs``,
``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens``) rendered by the
model's chat template into one prompt (``add_special_tokens`` also applies to ``input`` text:
default true there); ``encoding_format``: ``float`` or ``base64``
(little-endian float32, what the ``openai`` client asks for by default);
``truncate_prompt_tokens``: keep a prompt's last k tokens (-1: as many as the model takes);
``dimensions``: a Matryoshka model's output size (the first values, normalized after the cut),
a 400 naming it on any other model.  Every input is checked before any runs: a bad or too-long
one is a 400 naming ``input`` (``messages``).
"""

from __future__ import annotations

import time
import uuid

from jaxllm.pooling.async_engine import AsyncPoolingEngine
from serve.pooling_api import encode_vector, output_dimensions, request_prompts, usage
from serve.protocol import EmbeddingRequest, bad_request
from serve.state import ServerState


async def create_embedding(state: ServerState, engine: AsyncPoolingEngine, req: EmbeddingRequest) -> dict:
    state.check_model(req.model)
    core = engine.engine
    try:
        core.check_embedder()
    except ValueError as e:
        raise bad_request(str(e), "model") from None
    dims = output_dimensions(state, engine, req.dimensions)
    ids = request_prompts(state, engine, req)
    vecs = await engine.embed_ids(ids)
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": state.model_name,
            "data": [{"index": i, "object": "embedding",
                      "embedding": encode_vector(core.finish_embedding(v, dims), req.encoding_format)}
                     for i, v in enumerate(vecs)],
            "usage": usage(ids)}

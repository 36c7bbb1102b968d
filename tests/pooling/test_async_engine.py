"""The pooling server's engine thread (jaxllm/pooling/async_engine.py): requests waiting together
share one step, and once the server drains (SIGTERM) or shuts down a new request is refused at
once instead of waiting on a thread that will never answer it.  A stand-in encoder: what is
tested is the queueing, not the model."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from jaxllm.engine.async_engine import EngineStoppedError
from jaxllm.pooling.async_engine import AsyncPoolingEngine


class _Encoder:
    """Each prompt -> [its length, its first token]; records the batches it was given."""

    def __init__(self):
        self.batches = []

    def embed_ids(self, prompts, types):
        self.batches.append(len(prompts))
        return [np.array([len(p), p[0]], np.float32) for p in prompts]


def test_requests_are_answered_in_order():
    engine = AsyncPoolingEngine(_Encoder())
    try:
        async def go():
            return await asyncio.gather(engine.embed_ids([[5, 6], [7]]), engine.embed_ids([[9, 9, 9]]))
        first, second = asyncio.run(go())
        assert [v.tolist() for v in first] == [[2, 5], [1, 7]]
        assert [v.tolist() for v in second] == [[3, 9]]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("how", ["stop_accepting", "shutdown"])
def test_a_request_after_the_drain_is_refused_not_left_waiting(how):
    engine = AsyncPoolingEngine(_Encoder())
    getattr(engine, how)()

    async def go():
        return await asyncio.wait_for(engine.embed_ids([[5]]), timeout=5)
    with pytest.raises(EngineStoppedError, match="shutting down"):
        asyncio.run(go())
    engine.shutdown()

"""Server-sent events: ``data: {json}\\n\\n`` frames, ``data: [DONE]``, keep-alive comments.

``sse_response`` wraps an async generator of frames into a Quart response whose timeout is
lifted (Quart cuts any response after RESPONSE_TIMEOUT, 60 s, otherwise).  With a
keep-alive interval, a ``: keep-alive`` comment goes out whenever the stream has been
silent that long (SSE clients ignore comments; proxies see bytes and keep the connection).
A client that disconnects cancels the task iterating the generator: the CancelledError
travels into the generator, whose ``async with`` around the engine stream aborts the request.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from pydantic import BaseModel
from quart import Response

from serve.protocol import error_body

DONE = "data: [DONE]\n\n"
KEEP_ALIVE = ": keep-alive\n\n"

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def frame(obj: BaseModel | dict) -> str:
    """One SSE data frame.  Pydantic models are dumped with only the fields that were set."""
    if isinstance(obj, BaseModel):
        payload = obj.model_dump_json(exclude_unset=True)
    else:
        payload = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


def error_frame(status: int, message: str, param: str | None = None) -> str:
    return frame(error_body(status, message, param))


async def with_keep_alive(frames: AsyncIterator[str], interval: float) -> AsyncIterator[str]:
    """Yields ``frames``, adding a keep-alive comment after each ``interval`` seconds of silence."""
    it = frames.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEP_ALIVE
                continue
            fut, pending = pending, None
            try:
                item = fut.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None and not pending.done():
            # Cancelling the pending __anext__ delivers CancelledError inside ``frames``,
            # whose cleanup aborts the engine request.
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        aclose = getattr(frames, "aclose", None)
        if aclose is not None:
            await aclose()


def sse_response(frames: AsyncIterator[str], keep_alive_interval: float = 0.0) -> Response:
    body = with_keep_alive(frames, keep_alive_interval) if keep_alive_interval > 0 else frames
    resp = Response(body, status=200, mimetype="text/event-stream", headers=SSE_HEADERS)
    resp.timeout = None  # a long generation must not be cut after Quart's RESPONSE_TIMEOUT
    return resp

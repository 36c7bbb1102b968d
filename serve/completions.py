"""``POST /v1/completions``: one or several prompts (text or token ids) -> text, or an SSE stream.

Several prompts become several engine requests (``<id>-<i>``) whose outputs are merged;
choice ``i * n + j`` is prompt ``i``'s ``j``-th sample, as in vLLM.  No chunk is sent
before the first token, nor for a step whose text is held back (a possible stop string),
unless it carries logprobs or token ids that would otherwise be lost.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from http import HTTPStatus
from itertools import chain, repeat
from typing import AsyncIterator

from pydantic import BaseModel
from quart import Response

from jaxllm.engine.protocol import OutputStream
from jaxllm.engine.tokenizer import encode
from jaxllm.errors import EngineDeadError
from jaxllm.outputs import RequestOutput
from jaxllm.request import EngineRequest
from serve.logprobs import completion_logprobs, prompt_logprobs_json
from serve.protocol import (APIError, CompletionRequest, CompletionResponse, CompletionResponseChoice,
                            CompletionResponseStreamChoice, CompletionStreamResponse, bad_request, now_s)
from serve.sse import DONE, error_frame, frame, sse_response
from serve.state import ServerState
from serve.structured import resolve_constraint

log = logging.getLogger("jaxllm.serve")

COMPLETION_FIELDS = set(CompletionRequest.model_fields)


def _prompts(state: ServerState, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """Each prompt as (text or None, token ids): text is tokenized here (the request's
    add_special_tokens), token ids are decoded for echo."""
    p = req.prompt
    if isinstance(p, str):
        items: list = [p]
    elif not p:
        raise bad_request("prompt cannot be an empty list", "prompt")
    elif isinstance(p[0], int):
        items = [p]
    else:
        items = list(p)
    out = []
    for item in items:
        if isinstance(item, str):
            tok = state.require_tokenizer("a text prompt")
            ids = encode(tok, item, add_special_tokens=req.add_special_tokens)
            kept = req.truncated(ids, state.max_model_len)
            # A truncated prompt's text is what the model saw (for echo).
            out.append((item if kept is ids else tok.decode(kept, skip_special_tokens=False), kept))
        else:
            item = req.truncated(item, state.max_model_len)
            text = None
            if req.echo and state.tokenizer is not None:
                text = state.tokenizer.decode(item, skip_special_tokens=False)
            out.append((text, item))
    return out


def _process(state: ServerState, req: CompletionRequest, request_id: str) -> list[EngineRequest]:
    """One engine request per prompt (``<id>-<i>``), each validated once by the input processor;
    the constraint is resolved and the SamplingParams built once for all of them."""
    constraint = resolve_constraint(req)
    prompts = _prompts(state, req)
    requests = []
    try:
        sp = req.to_sampling_params(state.max_tokens(req.max_tokens), state.defaults, state.engine.vocab_size,
                                    constraint.params)
        for i, (text, ids) in enumerate(prompts):
            requests.append(state.process(f"{request_id}-{i}", req.engine_prompt(text, ids), sp, req.priority, req.model))
    except ValueError as e:
        raise state.value_error(e, COMPLETION_FIELDS, constraint.error_aliases()) from None
    return requests


async def create_completion(state: ServerState, req: CompletionRequest) -> Response | BaseModel:
    state.check_model(req.model)
    req.check_stream_options()
    if req.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of is not supported (only best_of == n), got best_of={req.best_of}", "best_of")
    request_id = state.request_id("cmpl", req.request_id)
    requests = _process(state, req, request_id)
    streams = state.add_requests(requests, stream=bool(req.stream))
    ctx = _Ctx(state, req, streams, requests, request_id, now_s())
    if req.stream:
        return sse_response(_stream(ctx), state.config.sse_keep_alive_interval)
    return await _full(ctx)


@dataclass(frozen=True)
class _Ctx:
    state: ServerState
    req: CompletionRequest
    streams: list[OutputStream]
    requests: list[EngineRequest]
    request_id: str
    created: int


async def _merged(streams: list[OutputStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come; leaving early aborts them all."""
    if len(streams) == 1:
        async with streams[0]:
            async for out in streams[0]:
                yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, s: OutputStream):
        try:
            async with s:
                async for out in s:
                    q.put_nowait((i, out))
        except Exception as e:
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, end))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            s.abort()


async def _stream(c: _Ctx) -> AsyncIterator[str]:
    req, state = c.req, c.state
    tok = state.tokenizer
    model = state.model_name
    n = req.n
    num = len(c.requests) * n
    include_usage, continuous = req.include_usage()
    want_ids = bool(req.return_token_ids)
    counts = [0] * num
    offsets = [0] * num
    echoed = [False] * num
    cached = [0] * len(c.requests)
    merged = _merged(c.streams)
    try:
        async for p_idx, ro in merged:
            prompt = c.requests[p_idx]
            cached[p_idx] = max(cached[p_idx], ro.num_cached_tokens)
            for out in ro.outputs:
                i = p_idx * n + out.index
                # The prompt goes out with the first token, never on its own.
                echo = req.echo and not echoed[i]
                text = (prompt.prompt or "") + out.text if echo else out.text
                counts[i] += len(out.token_ids)
                logprobs = None
                if req.logprobs is not None and (out.token_ids or echo):
                    positions = zip(out.token_ids, out.logprobs or repeat(None))
                    if echo:
                        positions = chain(zip(prompt.prompt_token_ids, ro.prompt_logprobs or repeat(None)), positions)
                    logprobs = completion_logprobs(tok, positions, req.logprobs, offsets[i],
                                                   bool(req.return_tokens_as_token_ids))
                ids_to_send = want_ids and (out.token_ids or echo)
                if not text and out.finish_reason is None and logprobs is None and not ids_to_send:
                    continue  # nothing the client can use yet
                first = not echoed[i]
                echoed[i] = echoed[i] or req.echo or want_ids
                offsets[i] += len(text)
                choice = CompletionResponseStreamChoice(index=i, text=text, logprobs=logprobs,
                                                        finish_reason=out.finish_reason, stop_reason=out.stop_reason)
                if want_ids:
                    choice.token_ids = list(out.token_ids)
                    if first:
                        choice.prompt_token_ids = prompt.prompt_token_ids
                chunk = CompletionStreamResponse(id=c.request_id, created=c.created, model=model, choices=[choice])
                if continuous:
                    chunk.usage = state.usage(prompt.num_prompt_tokens, counts[i])
                yield frame(chunk)
        if include_usage:
            pt = sum(r.num_prompt_tokens for r in c.requests)
            yield frame(CompletionStreamResponse(id=c.request_id, created=c.created, model=model, choices=[],
                                                 usage=state.usage(pt, sum(counts), sum(cached))))
    except EngineDeadError as e:
        yield error_frame(HTTPStatus.INTERNAL_SERVER_ERROR, str(e))
    except ValueError as e:
        yield error_frame(HTTPStatus.BAD_REQUEST, str(e))
    except Exception as e:
        log.exception("completion stream %s failed", c.request_id)
        yield error_frame(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")
    finally:
        await merged.aclose()
    yield DONE


async def _full(c: _Ctx) -> CompletionResponse:
    """Each request's one FINAL_ONLY output: the output processor's whole sequences."""
    req, state = c.req, c.state
    n = req.n
    finals: list[RequestOutput | None] = [None] * len(c.requests)
    merged = _merged(c.streams)
    try:
        async for p_idx, ro in merged:
            finals[p_idx] = ro
    except EngineDeadError as e:
        raise APIError(HTTPStatus.INTERNAL_SERVER_ERROR, str(e)) from None
    except ValueError as e:
        raise APIError(HTTPStatus.BAD_REQUEST, str(e)) from None
    finally:
        await merged.aclose()
    choices = []
    completion_tokens = 0
    for p_idx, (prompt, ro) in enumerate(zip(c.requests, finals)):
        for out in sorted(ro.outputs, key=lambda o: o.index):
            completion_tokens += len(out.token_ids)
            text = out.text
            positions = zip(out.token_ids, out.logprobs or repeat(None))
            if req.echo:
                text = (prompt.prompt or "") + text
                positions = chain(zip(prompt.prompt_token_ids, ro.prompt_logprobs or repeat(None)), positions)
            choices.append(CompletionResponseChoice(
                index=p_idx * n + out.index, text=text,
                logprobs=completion_logprobs(state.tokenizer, positions, req.logprobs, 0,
                                             bool(req.return_tokens_as_token_ids))
                if req.logprobs is not None else None,
                finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                token_ids=out.token_ids if req.return_token_ids else None,
                prompt_token_ids=prompt.prompt_token_ids if req.return_token_ids else None,
                prompt_logprobs=prompt_logprobs_json(ro.prompt_logprobs) if req.prompt_logprobs is not None else None))
    pt = sum(r.num_prompt_tokens for r in c.requests)
    cached = sum(ro.num_cached_tokens for ro in finals)
    return CompletionResponse(id=c.request_id, created=c.created, model=state.model_name, choices=choices,
                              usage=state.usage(pt, completion_tokens, cached))

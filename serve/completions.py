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
from typing import AsyncIterator

from pydantic import BaseModel
from quart import Response

from jaxllm.engine.async_engine import RequestStream
from jaxllm.engine.tokenizer import encode
from jaxllm.errors import EngineDeadError
from jaxllm.outputs import Logprob, RequestOutput
from serve.protocol import (APIError, CompletionLogProbs, CompletionRequest, CompletionResponse,
                            CompletionResponseChoice, CompletionResponseStreamChoice, CompletionStreamResponse,
                            bad_request, now_s, prompt_logprobs_json, random_id)
from serve.sse import DONE, error_frame, frame, sse_response
from serve.state import Choices, ServerState

log = logging.getLogger("jaxllm.serve")

COMPLETION_FIELDS = set(CompletionRequest.model_fields)


def _completion_logprobs(tokenizer, token_ids: list[int], steps: list | None, num: int,
                         initial_offset: int) -> CompletionLogProbs:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (the sampled token and
    the ``num`` most likely, as vLLM and the old OpenAI API return them), text_offset."""
    offsets: list[int] = []
    token_lps: list[float | None] = []
    tokens: list[str] = []
    tops: list[dict[str, float] | None] = []
    last_len = 0
    for i, tid in enumerate(token_ids):
        step = steps[i] if steps is not None and i < len(steps) else None
        if step is None:  # the first prompt token has no logprob
            token = _token_str(tokenizer, tid, None)
            token_lps.append(None)
            tops.append(None)
        else:
            lp = step.get(tid)
            token = _token_str(tokenizer, tid, lp)
            token_lps.append(max(lp.logprob, -9999.0) if lp is not None else None)
            tops.append({_token_str(tokenizer, k, v): max(v.logprob, -9999.0)
                         for j, (k, v) in enumerate(step.items()) if j <= num})
        tokens.append(token)
        offsets.append(initial_offset if not offsets else offsets[-1] + last_len)
        last_len = len(token)
    # Built in one go: stream chunks are dumped with only the fields that were set.
    return CompletionLogProbs(text_offset=offsets, token_logprobs=token_lps, tokens=tokens, top_logprobs=tops)


def _token_str(tokenizer, tid: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid]) if tokenizer is not None else f"token_id:{tid}"


@dataclass(frozen=True)
class _Prompt:
    text: str | None
    ids: list[int]


def _prompts(state: ServerState, req: CompletionRequest) -> list[_Prompt]:
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
            out.append(_Prompt(item, ids))
        else:
            text = None
            if req.echo and state.tokenizer is not None:
                text = state.tokenizer.decode(item, skip_special_tokens=False)
            out.append(_Prompt(text, list(item)))
        state.check_prompt_len(len(out[-1].ids), "prompt")
    return out


async def create_completion(state: ServerState, req: CompletionRequest) -> Response | BaseModel:
    state.check_model(req.model)
    req.check_stream_options()
    req.check_cache_salt()
    if req.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of is not supported (only best_of == n), got best_of={req.best_of}", "best_of")
    prompts = _prompts(state, req)
    params = []
    for pr in prompts:
        try:
            params.append(req.to_sampling_params(state.max_tokens(len(pr.ids), req.max_tokens), state.defaults,
                                                 state.engine.vocab_size))
        except ValueError as e:
            raise state.value_error(e, COMPLETION_FIELDS) from None
    request_id = random_id("cmpl")
    streams: list[RequestStream] = []
    try:
        for i, (pr, sp) in enumerate(zip(prompts, params)):
            streams.append(state.add_request(f"{request_id}-{i}", req.engine_prompt(pr.text, pr.ids), sp,
                                             req.priority))
    except (EngineDeadError, ValueError, APIError) as e:
        for s in streams:
            s.abort()
        if isinstance(e, APIError):
            raise
        if isinstance(e, EngineDeadError):
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(e)) from None
        if req.echo and req.logprobs is not None and req.prompt_logprobs is None and "prompt_logprobs" in str(e):
            # vLLM scores the echoed prompt too; say why a request that never named it is refused.
            raise bad_request(f"echo with logprobs returns the prompt's logprobs, and {e}", "echo") from None
        raise state.value_error(e, COMPLETION_FIELDS) from None
    ctx = _Ctx(state, req, streams, prompts, request_id, now_s())
    if req.stream:
        return sse_response(_stream(ctx), state.config.sse_keep_alive_interval)
    return await _full(ctx)


@dataclass(frozen=True)
class _Ctx:
    state: ServerState
    req: CompletionRequest
    streams: list[RequestStream]
    prompts: list[_Prompt]
    request_id: str
    created: int


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come; leaving early aborts them all."""
    if len(streams) == 1:
        async with streams[0]:
            async for out in streams[0]:
                yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, s: RequestStream):
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
    num = len(c.prompts) * n
    include_usage, continuous = req.include_usage()
    want_ids = bool(req.return_token_ids)
    counts = [0] * num
    offsets = [0] * num
    echoed = [False] * num
    cached = [0] * len(c.prompts)
    merged = _merged(c.streams)
    try:
        async for p_idx, ro in merged:
            prompt = c.prompts[p_idx]
            cached[p_idx] = max(cached[p_idx], ro.num_cached_tokens)
            for out in ro.outputs:
                i = p_idx * n + out.index
                text, ids, lps = out.text, list(out.token_ids), out.logprobs
                prompt_ids = None
                if not echoed[i] and (req.echo or want_ids):
                    prompt_ids = prompt.ids if want_ids else None
                if req.echo and not echoed[i]:
                    # The prompt goes out with the first token, never on its own.
                    text = (prompt.text or "") + text
                    ids = prompt.ids + ids
                    lps = (list(ro.prompt_logprobs) if ro.prompt_logprobs is not None
                           else [None] * len(prompt.ids)) + list(lps or [])
                counts[i] += len(out.token_ids)
                logprobs = None
                if req.logprobs is not None and ids:
                    logprobs = _completion_logprobs(tok, ids, lps, req.logprobs, offsets[i])
                if not text and out.finish_reason is None and logprobs is None and not (want_ids and ids):
                    continue  # nothing the client can use yet
                echoed[i] = echoed[i] or req.echo or want_ids
                offsets[i] += len(text)
                choice = CompletionResponseStreamChoice(index=i, text=text, logprobs=logprobs,
                                                        finish_reason=out.finish_reason, stop_reason=out.stop_reason)
                if want_ids:
                    choice.token_ids = list(out.token_ids)
                    if prompt_ids is not None:
                        choice.prompt_token_ids = prompt_ids
                chunk = CompletionStreamResponse(id=c.request_id, created=c.created, model=model, choices=[choice])
                if continuous:
                    chunk.usage = state.usage(len(prompt.ids), counts[i])
                yield frame(chunk)
        if include_usage:
            pt = sum(len(p.ids) for p in c.prompts)
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
    req, state = c.req, c.state
    n = req.n
    num = len(c.prompts) * n
    ch = Choices(num)
    prompt_logprobs: list = [None] * len(c.prompts)
    cached = [0] * len(c.prompts)
    merged = _merged(c.streams)
    try:
        async for p_idx, ro in merged:
            cached[p_idx] = max(cached[p_idx], ro.num_cached_tokens)
            if ro.prompt_logprobs is not None:
                prompt_logprobs[p_idx] = ro.prompt_logprobs
            for out in ro.outputs:
                ch.add(p_idx * n + out.index, out)
    except EngineDeadError as e:
        raise APIError(HTTPStatus.INTERNAL_SERVER_ERROR, str(e)) from None
    except ValueError as e:
        raise APIError(HTTPStatus.BAD_REQUEST, str(e)) from None
    finally:
        await merged.aclose()
    choices = []
    for i in range(num):
        prompt = c.prompts[i // n]
        text, ids, lps = ch.text(i), ch.token_ids[i], ch.logprobs[i]
        if req.echo:
            text = (prompt.text or "") + text
            plp = prompt_logprobs[i // n]
            lps = (list(plp) if plp is not None else [None] * len(prompt.ids)) + lps
            ids = prompt.ids + ids
        lp = _completion_logprobs(state.tokenizer, ids, lps, req.logprobs, 0) if req.logprobs is not None else None
        choices.append(CompletionResponseChoice(
            index=i, text=text, logprobs=lp, finish_reason=ch.finish[i], stop_reason=ch.stop_reason[i],
            token_ids=ch.token_ids[i] if req.return_token_ids else None,
            prompt_token_ids=prompt.ids if req.return_token_ids else None,
            prompt_logprobs=(prompt_logprobs_json(prompt_logprobs[i // n]) if req.prompt_logprobs is not None
                             else None)))
    pt = sum(len(p.ids) for p in c.prompts)
    resp = CompletionResponse(id=c.request_id, created=c.created, model=state.model_name, choices=choices,
                              usage=state.usage(pt, ch.num_tokens, sum(cached)))
    return resp

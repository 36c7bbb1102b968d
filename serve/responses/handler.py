"""The Responses endpoints' logic: create (whole, streamed or in the background), retrieve,
delete, cancel, list input items.  Generation goes through the chat path (serve/chat.py's
``start_chat``: rendering, tool and reasoning parsers, the one constraint resolver), so a
response's text is the chat endpoint's text for the same conversation.

With a ``--reasoning-parser``, ``usage.output_tokens_details.reasoning_tokens`` counts the
output tokens that were reasoning (serve/reasoning/base.py:ReasoningParser.reasoning_span).
With ``include: ["message.output_text.logprobs"]`` the message's ``output_text`` carries the
logprobs of the output tokens after the reasoning (all of them when there is none; with
function calls too, their tokens are the message's, as vLLM puts every token there); a stream
sends each token's logprobs on an ``output_text.delta`` (the tokens whose text is held back
on the next one, or on a last delta with empty text), so a stream's logprobs, joined, are the
whole response's.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import AsyncIterator

from jaxllm.errors import EngineDeadError
from serve.chat import ChatCtx, chat_response, final_output, render_messages, start_chat
from serve.images import load_chat_images
from serve.logprobs import chat_logprobs
from serve.protocol import APIError, bad_request, now_s
from serve.responses import objects as obj
from serve.responses.convert import chat_messages, chat_request, input_items, new_id, output_logprobs, remap
from serve.responses.protocol import ResponsesRequest
from serve.responses.store import ResponseStore
from serve.sse import sse_response
from serve.state import ServerState

log = logging.getLogger("jaxllm.serve")


@dataclass
class InFlight:
    """A response being generated: what cancel needs to abort it and wait for its end."""
    engine_request_id: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    final: dict | None = None


@dataclass
class ResponsesState:
    store: ResponseStore | None
    inflight: dict[str, InFlight] = field(default_factory=dict)
    tasks: set = field(default_factory=set)
    """Background responses' tasks (kept referenced until they end)."""


def not_found(rid: str) -> APIError:
    return APIError(HTTPStatus.NOT_FOUND, f"Response with id '{rid}' not found.", "response_id")


def _stored(rs: ResponsesState, rid: str) -> dict:
    got = rs.store.get(rid) if rs.store is not None else None
    if got is None:
        raise not_found(rid)
    return got


@dataclass
class _Job:
    state: ServerState
    rs: ResponsesState
    req: ResponsesRequest
    rid: str
    created: int
    items: list[dict]
    history: list[dict]
    ctx: ChatCtx

    def snapshot(self, status: str, output: list[dict], usage: dict | None = None, error: dict | None = None,
            incomplete: str | None = None) -> dict:
        return obj.response_object(self.req, self.rid, self.state.model_name, self.created, status, output, usage,
                                   error, incomplete)

    async def save(self, response: dict) -> None:
        if self.req.store and self.rs.store is not None:
            await self.rs.store.put_async(response, self.items, self.history + self.items)


async def create_response(state: ServerState, rs: ResponsesState, req: ResponsesRequest):
    state.check_model(req.model)
    if req.background and not req.store:
        raise bad_request("background responses must be stored; set store to true", "background")
    if req.background and rs.store is None:
        raise bad_request("background responses need the responses store, which this server runs without "
                          "(--responses-store none)", "background")
    history: list[dict] = []
    if req.previous_response_id is not None:
        conv = rs.store.conversation(req.previous_response_id) if rs.store is not None else None
        if conv is None:
            raise APIError(HTTPStatus.NOT_FOUND, f"Response with id '{req.previous_response_id}' not found.",
                           "previous_response_id")
        history = conv
    # vLLM's meaning: the client's request_id is the response's id.
    rid = req.request_id or new_id("resp")
    if rid in rs.inflight:
        raise bad_request(f"request_id {rid!r} names a response still in progress", "request_id")
    items = input_items(req)
    try:
        chat = _fitted(state, req, history + items) if req.truncation == "auto" else \
            chat_request(req, chat_messages(req.instructions, history + items), stream=req.stream)
        chat.check_supported()
        ctx = start_chat(state, chat, await load_chat_images(state, chat.messages))
    except APIError as e:
        raise remap(e) from None
    job = _Job(state, rs, req, rid, now_s(), items, history, ctx)
    flight = rs.inflight[rid] = InFlight(ctx.request_id)
    if req.stream:
        return sse_response(_events(job, flight), state.config.sse_keep_alive_interval)
    if req.background:
        queued = job.snapshot("in_progress", [])
        await job.save(queued)
        task = asyncio.get_running_loop().create_task(_whole(job, flight))
        rs.tasks.add(task)
        task.add_done_callback(rs.tasks.discard)
        return queued
    return await _whole(job, flight)


def _fitted(state: ServerState, req: ResponsesRequest, conversation: list[dict]):
    """``truncation: "auto"``: the oldest items are dropped (whole, OpenAI's rule; a tool result
    whose call was dropped goes with it) until the prompt leaves room for the output."""
    room = state.max_model_len - (req.max_output_tokens or 1)
    while True:
        chat = chat_request(req, chat_messages(req.instructions, conversation), stream=req.stream)
        _, ids = render_messages(state, chat.messages, add_generation_prompt=True, continue_final_message=False,
                                 chat_template=None, chat_template_kwargs=chat.template_kwargs(), tools=chat.tools,
                                 add_special_tokens=chat.add_special_tokens)
        if len(ids) <= room or len(conversation) <= 1:
            return chat
        conversation = conversation[1:]
        while len(conversation) > 1 and conversation[0].get("type") == "function_call_output":
            conversation = conversation[1:]


def _output_items(message, parsed: bool, logprobs: list[dict] | None) -> list[dict]:
    items = []
    if parsed and message.reasoning:
        items.append(obj.reasoning_item(message.reasoning))
    if message.content or not message.tool_calls:
        items.append(obj.message_item(message.content or "", logprobs=logprobs))
    for call in message.tool_calls or []:
        fn = call["function"]
        items.append(obj.function_call_item(call["id"], fn["name"], fn["arguments"]))
    return items


async def _whole(job: _Job, flight: InFlight) -> dict:
    try:
        try:
            final = await final_output(job.ctx)
        except APIError as e:
            failed = job.snapshot("failed", [], error={"code": "server_error", "message": e.message})
            await job.save(failed)
            if job.req.background:
                return failed
            raise
        chat = chat_response(job.ctx, final)
        choice = chat.choices[0]
        status, incomplete = obj.final_status(choice.finish_reason)
        u = chat.usage
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details is not None else 0
        reasoning = u.completion_tokens_details.reasoning_tokens if u.completion_tokens_details is not None else 0
        lp = None
        if output_logprobs(job.req):
            out = final.outputs[0]
            span = job.ctx.reasoning_span(out.token_ids, out.text)
            lp = obj.logprob_entries(choice.logprobs)[span[2] if span is not None else 0:]
        response = job.snapshot(status, _output_items(choice.message, job.ctx.choice_parser() is not None, lp),
                                obj.usage(u.prompt_tokens, u.completion_tokens, cached, reasoning),
                                incomplete=incomplete)
        await job.save(response)
        flight.final = response
        return response
    finally:
        job.rs.inflight.pop(job.rid, None)
        flight.done.set()


class _StreamItems:
    """The open output item of a stream and the events that open, grow and close items."""

    def __init__(self, ev: obj.EventCounter, ctx: ChatCtx, with_logprobs: bool):
        self.ev = ev
        self.ctx = ctx
        self.output: list[dict] = []
        self.open: dict | None = None
        self.text = ""
        self.calls: dict[int, dict] = {}
        # The whole output so far (the reasoning span and usage read it).
        self.token_ids: list[int] = []
        self.raw_text = ""
        # With include logprobs: every output token's entry; the next one a message delta takes
        # (None until the first message opens: then the tokens after the reasoning); the open
        # message's.
        self.logprobs: list[dict] | None = [] if with_logprobs else None
        self.lp_from: int | None = None
        self.message_lp: list[dict] = []

    def add(self, out) -> None:
        """One engine output's tokens (before the deltas they make are sent)."""
        self.token_ids.extend(out.token_ids)
        self.raw_text += out.text
        if self.logprobs is not None and out.token_ids:
            c = self.ctx
            self.logprobs += obj.logprob_entries(chat_logprobs(c.state.tokenizer, out.token_ids, out.logprobs,
                                                               c.req.top_logprobs or 0))

    def reasoning_tokens(self) -> int:
        span = self.ctx.reasoning_span(self.token_ids, self.raw_text)
        return 0 if span is None else span[1] - span[0]

    def _take_logprobs(self) -> list[dict]:
        """The entries not yet sent, for the open message."""
        if self.logprobs is None:
            return []
        if self.lp_from is None:
            span = self.ctx.reasoning_span(self.token_ids, self.raw_text)
            self.lp_from = span[2] if span is not None else 0
        got = self.logprobs[self.lp_from:]
        self.lp_from = max(self.lp_from, len(self.logprobs))
        self.message_lp += got
        return got

    def _close(self) -> list[str]:
        it, self.open = self.open, None
        if it is None:
            return []
        idx = self.output.index(it)
        if it["type"] == "message":
            frames = []
            rest = self._take_logprobs()
            if rest:  # tokens whose text was held back (or made none, as EOS): a last, empty delta
                frames.append(self.ev.frame("response.output_text.delta", item_id=it["id"], output_index=idx,
                                            content_index=0, delta="", logprobs=rest))
            part = obj.output_text(self.text, self.message_lp)
            frames += [self.ev.frame("response.output_text.done", item_id=it["id"], output_index=idx,
                                     content_index=0, text=self.text, logprobs=self.message_lp),
                       self.ev.frame("response.content_part.done", item_id=it["id"], output_index=idx,
                                     content_index=0, part=part)]
            it.update(content=[part], status="completed")
        else:
            part = {"type": "reasoning_text", "text": self.text}
            frames = [self.ev.frame("response.reasoning_text.done", item_id=it["id"], output_index=idx,
                                    content_index=0, text=self.text)]
            it.update(content=[part], status="completed")
        frames.append(self.ev.frame("response.output_item.done", output_index=idx, item=it))
        return frames

    def text_delta(self, kind: str, delta: str) -> list[str]:
        frames = []
        if self.open is None or self.open["type"] != kind:
            frames += self._close()
            it = obj.message_item("", "in_progress") if kind == "message" else obj.reasoning_item("", "in_progress")
            self.output.append(it)
            self.open, self.text = it, ""
            self.message_lp = []
            idx = len(self.output) - 1
            frames.append(self.ev.frame("response.output_item.added", output_index=idx, item=dict(it)))
            if kind == "message":
                frames.append(self.ev.frame("response.content_part.added", item_id=it["id"], output_index=idx,
                                            content_index=0, part=obj.output_text("")))
        idx = len(self.output) - 1
        self.text += delta
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": self._take_logprobs()} if kind == "message" else {}
        frames.append(self.ev.frame(name, item_id=self.open["id"], output_index=idx, content_index=0, delta=delta,
                                    **extra))
        return frames

    def tool_delta(self, call: dict) -> list[str]:
        frames = []
        i = call.get("index", 0)
        fn = call.get("function") or {}
        if i not in self.calls:
            frames += self._close()
            it = obj.function_call_item(call.get("id") or new_id("call"), fn.get("name", ""), "", "in_progress")
            self.output.append(it)
            self.calls[i] = it
            frames.append(self.ev.frame("response.output_item.added", output_index=len(self.output) - 1,
                                        item=dict(it)))
        it = self.calls[i]
        if fn.get("arguments"):
            it["arguments"] += fn["arguments"]
            frames.append(self.ev.frame("response.function_call_arguments.delta", item_id=it["id"],
                                        output_index=self.output.index(it), delta=fn["arguments"]))
        return frames

    def finish(self) -> list[str]:
        frames = self._close()
        for it in self.calls.values():
            idx = self.output.index(it)
            it["status"] = "completed"
            frames.append(self.ev.frame("response.function_call_arguments.done", item_id=it["id"], output_index=idx,
                                        arguments=it["arguments"]))
            frames.append(self.ev.frame("response.output_item.done", output_index=idx, item=it))
        return frames


async def _events(job: _Job, flight: InFlight) -> AsyncIterator[str]:
    """The event stream; it always ends with response.completed, .incomplete or .failed."""
    ev = obj.EventCounter()
    items = _StreamItems(ev, job.ctx, output_logprobs(job.req))
    start = job.snapshot("in_progress", [])
    yield ev.frame("response.created", response=start)
    yield ev.frame("response.in_progress", response=start)
    parser = job.ctx.choice_parser()
    finish, completion, cached = None, 0, 0
    final = None
    try:
        async with job.ctx.stream:
            async for ro in job.ctx.stream:
                cached = max(cached, ro.num_cached_tokens)
                for out in ro.outputs:
                    completion += len(out.token_ids)
                    items.add(out)
                    done = out.finish_reason is not None
                    if parser is None:
                        deltas = [("message", out.text)] if out.text else []
                    else:
                        deltas = []
                        for d in parser.feed(out.text, done):
                            if d.reasoning:
                                deltas.append(("reasoning", d.reasoning))
                            if d.content:
                                deltas.append(("message", d.content))
                            for call in d.tool_calls or []:
                                deltas.append(("tool", call))
                    for kind, delta in deltas:
                        for f in items.tool_delta(delta) if kind == "tool" else items.text_delta(kind, delta):
                            yield f
                    if done:
                        finish = out.finish_reason
        for f in items.finish():
            yield f
        if not any(it["type"] != "reasoning" for it in items.output) and not items.calls:
            for f in items.text_delta("message", ""):
                yield f  # an empty answer is still one (empty) message, as in the whole response
            for f in items.finish():
                yield f
        status, incomplete = obj.final_status(finish)
        final = job.snapshot(status, items.output, obj.usage(len(job.ctx.prompt_ids), completion, cached,
                                                             items.reasoning_tokens()), incomplete=incomplete)
        await job.save(final)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield ev.frame(kind, response=final)
    except Exception as e:  # an engine error still ends the stream in the protocol's shape
        if not isinstance(e, (EngineDeadError, ValueError)):
            log.exception("responses stream %s failed", job.rid)
        final = job.snapshot("failed", items.output, error={"code": "server_error", "message": f"{e}"})
        try:
            await job.save(final)
        except Exception:
            log.exception("responses: could not store the failed response %s", job.rid)
        yield ev.frame("response.failed", response=final)
    finally:
        flight.final = final
        job.rs.inflight.pop(job.rid, None)
        flight.done.set()


def retrieve(rs: ResponsesState, rid: str) -> dict:
    return _stored(rs, rid)


def delete(rs: ResponsesState, rid: str) -> dict:
    if rs.store is None or not rs.store.delete(rid):
        raise not_found(rid)
    return {"id": rid, "object": "response.deleted", "deleted": True}


async def cancel(state: ServerState, rs: ResponsesState, rid: str) -> dict:
    """Aborts an in-flight (streamed or background) response; the engine frees its KV blocks."""
    flight = rs.inflight.get(rid)
    if flight is None:
        got = _stored(rs, rid)
        raise bad_request(f"response '{rid}' is {got.get('status')}, not in progress; only an in-flight response "
                          "can be cancelled", "response_id")
    state.engine.abort(flight.engine_request_id)
    try:
        await asyncio.wait_for(flight.done.wait(), 30)
    except asyncio.TimeoutError:
        raise APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"response '{rid}' did not stop in 30 s") from None
    return flight.final or {"id": rid, "object": "response", "status": "cancelled"}


def list_input_items(rs: ResponsesState, rid: str, limit: int, order: str, after: str | None) -> dict:
    got = rs.store.input_items(rid) if rs.store is not None else None
    if got is None:
        raise not_found(rid)
    items = got if order == "asc" else list(reversed(got))
    if after is not None:
        ids = [it.get("id") for it in items]
        if after not in ids:
            raise bad_request(f"after: no input item {after!r} in response '{rid}'", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

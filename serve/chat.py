"""``POST /v1/chat/completions``: messages -> chat template -> engine -> a message or an SSE stream.

Streaming follows vLLM: the role frame (``delta: {role: "assistant", content: ""}``) is
written only once the engine has produced the request's first result, so an error before
the first token is the first thing the client reads (and a client's time to first token
measures real prefill).  Chunks without content are not sent; the finishing chunk carries
``finish_reason`` and vLLM's ``stop_reason``; an engine failure mid-stream becomes a
``data: {"error": ...}`` frame followed by ``data: [DONE]``.

Tools (vLLM's semantics): ``tools`` reach the chat template; ``tool_choice`` is resolved once
(serve/tool_choice.py); ``required`` and a named function add a JSON-schema constraint to
the request.  With a tool choice other than "none" or a ``--reasoning-parser``, each
choice's output goes through its own ``chat_parsing.ChoiceParser``: the message gets
``reasoning`` and ``tool_calls`` (``finish_reason`` "tool_calls"), and a stream sends
reasoning, content and tool-call deltas as the parsers release them.

``reasoning_effort`` reaches the chat template as the variable of that name (as vLLM passes
it); with a ``--reasoning-parser``, usage carries ``completion_tokens_details.reasoning_tokens``
(vLLM's rule: only with a parser).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import AsyncIterator

from pydantic import BaseModel
from quart import Response

from jaxllm.engine.protocol import OutputStream
from jaxllm.engine.processor import InvalidRequestError
from jaxllm.engine.render import render_chat_prompt, template_reads
from jaxllm.errors import EngineDeadError
from jaxllm.outputs import RequestOutput
from serve.chat_parsing import ChoiceParser
from serve.images import image_parts, load_chat_images, with_images
from serve.logprobs import chat_logprobs, prompt_logprobs_json
from serve.protocol import (APIError, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionResponseChoice,
                            ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse, ChatResponseMessage,
                            DeltaMessage, UsageInfo, bad_request, now_s)
from serve.sse import DONE, error_frame, frame, sse_response
from serve.state import ServerState
from serve.structured import resolve_constraint
from serve.tool_choice import NamedToolParser, RequiredToolParser, tool_choice_schema, tool_mode

log = logging.getLogger("jaxllm.serve")

CHAT_FIELDS = set(ChatCompletionRequest.model_fields)


def render_messages(state: ServerState, messages, *, add_generation_prompt: bool, continue_final_message: bool,
                    chat_template: str | None, chat_template_kwargs: dict | None, tools,
                    add_special_tokens: bool, documents: list[dict] | None = None) -> tuple[str, list[int]]:
    """The request's messages through the one chat renderer (jaxllm/engine/render.py); returns
    (prompt text, prompt token ids); a 400 naming the field when they do not render."""
    tok = state.require_tokenizer("chat")
    template = chat_template if chat_template is not None else state.chat_template
    try:
        r = render_chat_prompt(
            tok, [m.to_template_dict() for m in messages], add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=template,
            chat_template_kwargs=chat_template_kwargs,
            tools=None if tools is None else [t.to_template_dict() for t in tools], documents=documents,
            add_special_tokens=add_special_tokens)
    except InvalidRequestError as e:
        param = e.param
        if param == "chat_template" and chat_template is None:
            param = "messages"  # the server's template: the messages are what the client can change
        raise bad_request(str(e), param) from None
    return r.text, r.token_ids


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest) -> Response | BaseModel:
    images = await load_chat_images(state, req.messages)
    ctx = start_chat(state, req, images)
    if req.stream:
        return sse_response(_stream(ctx), state.config.sse_keep_alive_interval)
    return await full_response(ctx)


def start_chat(state: ServerState, req: ChatCompletionRequest, images: list | None = None) -> "ChatCtx":
    """Renders, validates and queues the request; its context holds the engine stream (also
    the Responses API's way in: serve/responses/handler.py).  ``images``: the messages' images,
    loaded by serve/images.py (which also refuses them to a text-only model)."""
    state.check_model(req.model)
    req.check_stream_options()
    mode = tool_mode(req, state.config.enable_auto_tool_choice and state.tool_parser is not None)
    if mode == "auto" and state.tool_parser.needs_special_tokens(state.tokenizer):
        req = req.model_copy(update={"skip_special_tokens": False})  # or the detokenizer drops the markers
    if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
        raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if req.top_logprobs is not None and req.top_logprobs < 0:
        raise bad_request(f"top_logprobs must be non-negative, got {req.top_logprobs}.", "top_logprobs")
    _check_template_reads_effort(state, req)
    if len(image_parts(state, req.messages)) != len(images or []):
        raise RuntimeError("start_chat: the messages' images were not loaded (serve/images.py:load_chat_images)")
    text, ids = render_messages(
        state, req.messages, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, chat_template=req.chat_template,
        chat_template_kwargs=req.template_kwargs(), tools=req.tools, add_special_tokens=req.add_special_tokens,
        documents=req.documents)
    ids = req.truncated(ids, state.max_model_len)
    if mode == "auto":
        _check_template_renders_tools(state, req, text)
    # required / named: the grammar makes the arguments parse and match the tools' schema.
    constraint = resolve_constraint(req, tool_choice_schema(req, mode))
    aliases = {"logprobs": "top_logprobs", "prompt": "messages", **constraint.error_aliases()}
    if req.max_completion_tokens is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    request_id = state.request_id("chatcmpl", req.request_id)
    try:
        params = req.to_sampling_params(state.max_tokens(req.requested_max_tokens()), state.defaults,
                                        state.engine.vocab_size, constraint.params)
        prompt = with_images(req.engine_prompt(text, ids), images or [])
        request = state.process(request_id, prompt, params, req.priority, req.model)
    except ValueError as e:
        raise state.value_error(e, CHAT_FIELDS, aliases) from None
    stream, = state.add_requests([request], stream=bool(req.stream))

    role = state.config.response_role if req.add_generation_prompt else req.messages[-1].role
    echo_text = ""
    if req.echo:
        last = req.messages[-1]
        if last.role == role:
            echo_text = last.text() or ""
    return ChatCtx(state, req, stream, request_id, now_s(), request.prompt_token_ids, role, echo_text, mode, text)


def _check_template_reads_effort(state: ServerState, req: ChatCompletionRequest) -> None:
    """A 400 when ``reasoning_effort`` is set and the chat template does not read the variable.
    vLLM drops it silently there; here a field that would change the output is honoured or
    refused: the client asked for an effort the model would never be told of."""
    if req.reasoning_effort is None:
        return
    template = req.chat_template if req.chat_template is not None else state.chat_template
    if not template_reads(state.require_tokenizer("chat"), template, "reasoning_effort"):
        raise bad_request("reasoning_effort: the chat template does not read the variable `reasoning_effort`, so "
                          "the effort would change nothing; use a template that does (--chat-template, or "
                          "chat_template), or leave the effort out", "reasoning_effort")


def _check_template_renders_tools(state: ServerState, req: ChatCompletionRequest, text: str) -> None:
    """A 400 when the chat template leaves ``tools`` out of the prompt: under "auto" the model
    would never learn of them (the built-in SmolLM2's template is one such)."""
    bare, _ = render_messages(
        state, req.messages, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, chat_template=req.chat_template,
        chat_template_kwargs=req.template_kwargs(), tools=None, add_special_tokens=req.add_special_tokens,
        documents=req.documents)
    if bare == text:
        raise bad_request('tool_choice "auto": the chat template does not render `tools`, so the model cannot see '
                          "them; use a template that does (--chat-template, or chat_template), or tool_choice "
                          '"required" or a named function, which constrain the output to the tools', "tools")


@dataclass(frozen=True)
class ChatCtx:
    state: ServerState
    req: ChatCompletionRequest
    stream: OutputStream
    request_id: str
    created: int
    prompt_ids: list[int]
    role: str
    echo_text: str
    tool_mode: str
    """"none", "auto", "required" or "named" (serve/tool_choice.py:tool_mode)."""
    prompt_text: str

    def choice_parser(self) -> ChoiceParser | None:
        """A fresh parser for one choice's output; None when the output is plain content."""
        state, req = self.state, self.req
        tok = state.tokenizer
        reasoning = state.reasoning_parser(tok, prompt_text=self.prompt_text) if state.reasoning_parser else None
        tools = [t.to_template_dict() for t in req.tools or []]
        tool_parser = None
        if self.tool_mode == "auto":
            tool_parser = state.tool_parser(tok, tools)
        elif self.tool_mode == "required":
            tool_parser = RequiredToolParser(tok, tools)
        elif self.tool_mode == "named":
            tool_parser = NamedToolParser(req.tool_choice.function.name, tok, tools)
        if reasoning is None and tool_parser is None:
            return None
        return ChoiceParser(reasoning, tool_parser, parallel_tool_calls=req.parallel_tool_calls is not False)

    def reasoning_span(self, token_ids, text: str) -> tuple[int, int, int] | None:
        """(start, end, content_start) of one choice's whole output (serve/reasoning/base.py);
        None without a ``--reasoning-parser``."""
        state = self.state
        if state.reasoning_parser is None:
            return None
        return state.reasoning_parser(state.tokenizer, prompt_text=self.prompt_text).reasoning_span(token_ids, text)

    def reasoning_tokens(self, outputs) -> int | None:
        """The reasoning tokens of whole outputs (each with ``token_ids`` and ``text``), for
        usage; None without a ``--reasoning-parser``."""
        if self.state.reasoning_parser is None:
            return None
        spans = [self.reasoning_span(o.token_ids, o.text) for o in outputs]
        return sum(end - start for start, end, _ in spans)

    def finish_reason(self, reason: str | None, tools_called: bool) -> str | None:
        """vLLM's: "tool_calls" when an auto or required choice ended by stopping after calling
        tools; a named function's call ends with "stop", as OpenAI's does."""
        if reason == "stop" and tools_called and self.tool_mode in ("auto", "required"):
            return "tool_calls"
        return reason


@dataclass
class _Whole:
    """A streamed choice's output so far (``token_ids`` and ``text``, as a whole output has them)."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""

    def add(self, out) -> None:
        self.token_ids.extend(out.token_ids)
        self.text += out.text


async def _stream(c: ChatCtx) -> AsyncIterator[str]:
    req, state = c.req, c.state
    tok = state.tokenizer
    model = state.model_name
    n = req.n
    include_usage, continuous = req.include_usage()
    want_ids = bool(req.return_token_ids)
    num_prompt = len(c.prompt_ids)
    counts = [0] * n

    def chunk(choice, usage=None, **extra) -> str:
        resp = ChatCompletionStreamResponse(id=c.request_id, created=c.created, model=model, choices=[choice],
                                            **extra)
        if usage is not None:
            resp.usage = usage
        return frame(resp)

    def usage_for(i) -> UsageInfo | None:
        if not continuous:
            return None
        return state.usage(num_prompt, counts[i])

    first = True
    cached = 0
    parsers = [c.choice_parser() for _ in range(n)]
    # Each choice's whole output so far, for the final usage's reasoning tokens.
    wholes = [_Whole() for _ in range(n)]
    try:
        async with c.stream:
            async for ro in c.stream:
                cached = max(cached, ro.num_cached_tokens)
                if first:
                    # The engine has produced this request's first result: only now does the
                    # client learn the role (vLLM sends it per choice).
                    first = False
                    for i in range(n):
                        extra = {"prompt_token_ids": c.prompt_ids} if want_ids and i == 0 else {}
                        yield chunk(ChatCompletionResponseStreamChoice(
                            index=i, delta=DeltaMessage(role=c.role, content=""), logprobs=None, finish_reason=None),
                            usage_for(i), **extra)
                        if c.echo_text:
                            yield chunk(ChatCompletionResponseStreamChoice(
                                index=i, delta=DeltaMessage(content=c.echo_text), logprobs=None, finish_reason=None),
                                usage_for(i))
                for out in ro.outputs:
                    i = out.index
                    counts[i] += len(out.token_ids)
                    if state.reasoning_parser is not None:
                        wholes[i].add(out)
                    lp = None
                    if req.logprobs and out.token_ids:
                        lp = chat_logprobs(tok, out.token_ids, out.logprobs, req.top_logprobs or 0,
                                           bool(req.return_tokens_as_token_ids))
                    if parsers[i] is not None:
                        for ch in _parsed_choices(c, parsers[i], out, lp, want_ids):
                            yield chunk(ch, usage_for(i))
                        continue
                    if not out.text and out.finish_reason is None and lp is None and not (want_ids and out.token_ids):
                        continue  # text held back (a possible stop string, an incomplete character)
                    choice = ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(content=out.text),
                                                                logprobs=lp, finish_reason=out.finish_reason)
                    if out.finish_reason is not None:
                        choice.stop_reason = out.stop_reason
                    if want_ids:
                        choice.token_ids = list(out.token_ids)
                    yield chunk(choice, usage_for(i))
        if include_usage:
            total = sum(counts)
            resp = ChatCompletionStreamResponse(id=c.request_id, created=c.created, model=model, choices=[],
                                                usage=state.usage(num_prompt, total, cached,
                                                                  c.reasoning_tokens(wholes)))
            yield frame(resp)
    except EngineDeadError as e:
        yield error_frame(HTTPStatus.INTERNAL_SERVER_ERROR, str(e))
    except ValueError as e:
        yield error_frame(HTTPStatus.BAD_REQUEST, str(e))
    except Exception as e:  # anything else still ends the stream in the protocol's shape
        log.exception("chat stream %s failed", c.request_id)
        yield error_frame(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")
    yield DONE


def _parsed_choices(c: ChatCtx, parser: ChoiceParser, out, lp, want_ids: bool):
    """One output's stream choices through the parsers: one per delta (reasoning, content or
    tool calls); logprobs and token ids ride on the first, the finish reason on the last."""
    final = out.finish_reason is not None
    deltas = parser.feed(out.text, final)
    if not c.req.include_reasoning:
        # vLLM's include_reasoning=false: the reasoning is parsed out and not sent.
        deltas = [DeltaMessage(**d.model_dump(exclude_unset=True, exclude={"reasoning"})) for d in deltas
                  if d.content is not None or d.tool_calls or d.role is not None]
    if not deltas and not final and lp is None and not (want_ids and out.token_ids):
        return []  # held back (a possible tag, a stop string, an incomplete character)
    choices = [ChatCompletionResponseStreamChoice(index=out.index, delta=d, logprobs=None, finish_reason=None)
               for d in deltas or [DeltaMessage()]]
    choices[0].logprobs = lp
    if want_ids:
        choices[0].token_ids = list(out.token_ids)
    if final:
        choices[-1].finish_reason = c.finish_reason(out.finish_reason, parser.tools_called)
        choices[-1].stop_reason = out.stop_reason
    return choices


async def full_response(c: ChatCtx) -> ChatCompletionResponse:
    """The request's one FINAL_ONLY output: the output processor's whole sequences."""
    return chat_response(c, await final_output(c))


async def final_output(c: ChatCtx) -> RequestOutput:
    """The engine's final result of a whole (not streamed) request; engine errors as APIError."""
    final: RequestOutput | None = None
    try:
        async with c.stream:
            async for ro in c.stream:
                final = ro
    except EngineDeadError as e:
        raise APIError(HTTPStatus.INTERNAL_SERVER_ERROR, str(e)) from None
    except ValueError as e:
        raise APIError(HTTPStatus.BAD_REQUEST, str(e)) from None
    return final


def chat_response(c: ChatCtx, final: RequestOutput) -> ChatCompletionResponse:
    """The chat completion of a final result: parsed messages, logprobs, usage."""
    req, state = c.req, c.state
    choices = []
    for out in sorted(final.outputs, key=lambda o: o.index):
        lp = None
        if req.logprobs:
            lp = chat_logprobs(state.tokenizer, out.token_ids, out.logprobs, req.top_logprobs or 0,
                               bool(req.return_tokens_as_token_ids))
        parser = c.choice_parser()
        if parser is None:
            message = ChatResponseMessage(role=c.role, content=c.echo_text + out.text)
            finish = out.finish_reason
        else:
            parsed = parser.parse(out.text)
            content = parsed.content
            if c.echo_text:
                content = c.echo_text + (content or "")
            message = ChatResponseMessage(role=c.role, content=content,
                                          reasoning=parsed.reasoning if req.include_reasoning else None,
                                          tool_calls=parsed.tool_calls)
            finish = c.finish_reason(out.finish_reason, bool(parsed.tool_calls))
        choices.append(ChatCompletionResponseChoice(
            index=out.index, message=message, logprobs=lp, finish_reason=finish, stop_reason=out.stop_reason,
            token_ids=out.token_ids if req.return_token_ids else None))
    completion = sum(len(out.token_ids) for out in final.outputs)
    return ChatCompletionResponse(
        id=c.request_id, created=c.created, model=state.model_name, choices=choices,
        usage=state.usage(len(c.prompt_ids), completion, final.num_cached_tokens, c.reasoning_tokens(final.outputs)),
        prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs) if req.prompt_logprobs is not None else None,
        prompt_token_ids=c.prompt_ids if req.return_token_ids else None)

"""``POST /v1/chat/completions``: messages -> chat template -> engine -> a message or an SSE stream.

Streaming follows vLLM: the role frame (``delta: {role: "assistant", content: ""}``) is
written only once the engine has produced the request's first result, so an error before
the first token is the first thing the client reads (and a client's time to first token
measures real prefill).  Chunks without content are not sent; the finishing chunk carries
``finish_reason`` and vLLM's ``stop_reason``; an engine failure mid-stream becomes a
``data: {"error": ...}`` frame followed by ``data: [DONE]``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import AsyncIterator

from pydantic import BaseModel
from quart import Response

from jaxllm.engine.protocol import OutputStream
from jaxllm.engine.tokenizer import encode, render_chat
from jaxllm.errors import EngineDeadError
from jaxllm.outputs import RequestOutput
from serve.logprobs import chat_logprobs, prompt_logprobs_json
from serve.protocol import (APIError, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionResponseChoice,
                            ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse, ChatResponseMessage,
                            DeltaMessage, UsageInfo, bad_request, now_s, random_id)
from serve.sse import DONE, error_frame, frame, sse_response
from serve.state import ServerState

log = logging.getLogger("jaxllm.serve")

CHAT_FIELDS = set(ChatCompletionRequest.model_fields)

# apply_chat_template's own arguments: not template variables a request may set.
_RESERVED_TEMPLATE_KWARGS = {
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"}


def render_messages(state: ServerState, messages, *, add_generation_prompt: bool, continue_final_message: bool,
                    chat_template: str | None, chat_template_kwargs: dict | None, tools,
                    add_special_tokens: bool) -> tuple[str, list[int]]:
    """Applies the chat template; returns (prompt text, prompt token ids)."""
    tok = state.require_tokenizer("chat")
    if add_generation_prompt and continue_final_message:
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                          "continue_final_message")
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise bad_request(f"chat_template_kwargs cannot set {', '.join(reserved)}", "chat_template_kwargs")
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if tools is not None:
        kwargs["tools"] = tools
    template = chat_template if chat_template is not None else state.chat_template
    try:
        text = render_chat(tok, [m.to_template_dict() for m in messages], add_generation_prompt=add_generation_prompt,
                           chat_template=template, chat_template_kwargs=kwargs)
    except ValueError as e:
        raise bad_request(str(e), "chat_template" if chat_template is not None else "messages") from None
    if not isinstance(text, str):
        raise bad_request("the chat template did not produce text", "chat_template_kwargs")
    return text, encode(tok, text, add_special_tokens=add_special_tokens)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest) -> Response | BaseModel:
    state.check_model(req.model)
    req.check_stream_options()
    if req.tool_choice not in (None, "none"):
        raise bad_request("tool calling is not supported by this server: tool_choice must be \"none\" or absent",
                          "tool_choice")
    if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
        raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if req.top_logprobs is not None and req.top_logprobs < 0:
        raise bad_request(f"top_logprobs must be non-negative, got {req.top_logprobs}.", "top_logprobs")
    text, ids = render_messages(
        state, req.messages, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, chat_template=req.chat_template,
        chat_template_kwargs=req.chat_template_kwargs, tools=req.tools, add_special_tokens=req.add_special_tokens)
    aliases = {"logprobs": "top_logprobs", "prompt": "messages", **req.error_aliases()}
    if req.max_completion_tokens is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    request_id = random_id("chatcmpl")
    try:
        params = req.to_sampling_params(state.max_tokens(len(ids), req.requested_max_tokens()), state.defaults,
                                        state.engine.vocab_size)
        request = state.process(request_id, req.engine_prompt(text, ids), params, req.priority)
    except ValueError as e:
        raise state.value_error(e, CHAT_FIELDS, aliases) from None
    stream, = state.add_requests([request], stream=bool(req.stream))

    role = state.config.response_role if req.add_generation_prompt else req.messages[-1].role
    echo_text = ""
    if req.echo:
        last = req.messages[-1].to_template_dict()
        if last.get("role") == role:
            echo_text = last.get("content") or ""
    ctx = _ChatCtx(state, req, stream, request_id, now_s(), request.prompt_token_ids, role, echo_text)
    if req.stream:
        return sse_response(_stream(ctx), state.config.sse_keep_alive_interval)
    return await _full(ctx)


@dataclass(frozen=True)
class _ChatCtx:
    state: ServerState
    req: ChatCompletionRequest
    stream: OutputStream
    request_id: str
    created: int
    prompt_ids: list[int]
    role: str
    echo_text: str


async def _stream(c: _ChatCtx) -> AsyncIterator[str]:
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
                    lp = None
                    if req.logprobs and out.token_ids:
                        lp = chat_logprobs(tok, out.token_ids, out.logprobs, req.top_logprobs or 0)
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
                                                usage=state.usage(num_prompt, total, cached))
            yield frame(resp)
    except EngineDeadError as e:
        yield error_frame(HTTPStatus.INTERNAL_SERVER_ERROR, str(e))
    except ValueError as e:
        yield error_frame(HTTPStatus.BAD_REQUEST, str(e))
    except Exception as e:  # anything else still ends the stream in the protocol's shape
        log.exception("chat stream %s failed", c.request_id)
        yield error_frame(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")
    yield DONE


async def _full(c: _ChatCtx) -> ChatCompletionResponse:
    """The request's one FINAL_ONLY output: the output processor's whole sequences."""
    req, state = c.req, c.state
    final: RequestOutput | None = None
    try:
        async with c.stream:
            async for ro in c.stream:
                final = ro
    except EngineDeadError as e:
        raise APIError(HTTPStatus.INTERNAL_SERVER_ERROR, str(e)) from None
    except ValueError as e:
        raise APIError(HTTPStatus.BAD_REQUEST, str(e)) from None
    choices = []
    for out in sorted(final.outputs, key=lambda o: o.index):
        lp = None
        if req.logprobs:
            lp = chat_logprobs(state.tokenizer, out.token_ids, out.logprobs, req.top_logprobs or 0)
        choices.append(ChatCompletionResponseChoice(
            index=out.index, message=ChatResponseMessage(role=c.role, content=c.echo_text + out.text), logprobs=lp,
            finish_reason=out.finish_reason, stop_reason=out.stop_reason,
            token_ids=out.token_ids if req.return_token_ids else None))
    completion = sum(len(out.token_ids) for out in final.outputs)
    return ChatCompletionResponse(
        id=c.request_id, created=c.created, model=state.model_name, choices=choices,
        usage=state.usage(len(c.prompt_ids), completion, final.num_cached_tokens),
        prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs) if req.prompt_logprobs is not None else None,
        prompt_token_ids=c.prompt_ids if req.return_token_ids else None)

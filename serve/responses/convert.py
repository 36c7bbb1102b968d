"""Responses input -> the chat endpoint's request: items become chat messages, function tools
become chat tools, ``text.format`` becomes ``response_format`` (so it reaches the one constraint
resolver, serve/structured.py), ``max_output_tokens`` becomes ``max_tokens``,
``reasoning.effort`` becomes ``reasoning_effort`` (the chat template's variable), and
``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` becomes ``logprobs`` and
``top_logprobs``.  The chat path then renders, constrains and parses exactly as
``/v1/chat/completions`` does.

Only ``function`` tools reach the model.  Other tool types (web_search, file_search,
code_interpreter, mcp, ...) are left out with a warning: vLLM offers such built-in tools only
when a tool server provides them and otherwise does not give them to the model; jaxllm has no
tool server.
"""

from __future__ import annotations

import logging
import uuid

from pydantic import ValidationError

from serve.protocol import APIError, ChatCompletionRequest, bad_request
from serve.responses.protocol import (OUTPUT_LOGPROBS, SAMPLING_EXTRAS, FunctionTool, InputImage, MessageItem,
                                      ResponsesRequest)

log = logging.getLogger("jaxllm.serve")

PARAMS = {"messages": "input", "response_format": "text", "max_tokens": "max_output_tokens",
          "max_completion_tokens": "max_output_tokens", "structured_outputs": "text", "reasoning_effort": "reasoning",
          "logprobs": "include"}
"""A chat field named in an error -> the Responses parameter the client sent."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def remap(e: APIError) -> APIError:
    """A chat-path error re-addressed to the Responses parameter it is about (an image part's
    ``messages[i].content[j].image_url`` is in ``input``)."""
    if e.param in PARAMS:
        e.param = PARAMS[e.param]
    elif e.param is not None and e.param.startswith("messages["):
        e.param = "input"
    return e


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's own input as stored item dicts (each with an id, as ``input_items`` lists them)."""
    if isinstance(req.input, str):
        if not req.input:
            raise bad_request("input is empty: send a string or a list of items", "input")
        items = [MessageItem(role="user", content=req.input)]
    else:
        items = req.input
    out = []
    for it in items:
        d = it.model_dump(exclude_none=True, by_alias=True)
        if isinstance(it, MessageItem):
            kind = "output_text" if it.role == "assistant" else "input_text"
            if it.has_images():
                # Parts kept in order (the images stay where the client put them); text parts as sent.
                d["content"] = [_stored_part(p, kind) for p in it.content]
            else:
                d["content"] = [{"type": kind, "text": it.text()}]
            d.setdefault("status", "completed")
        d.setdefault("id", new_id({"message": "msg", "function_call": "fc", "function_call_output": "fco",
                                   "reasoning": "rs"}[it.type]))
        out.append(d)
    return out


def _stored_part(p, kind: str) -> dict:
    if isinstance(p, InputImage):
        if p.image_url is None:
            why = "file_id needs OpenAI's Files API, which this server does not have" if p.file_id else "no image_url"
            raise bad_request(f"input_image: {why}; send image_url (a data: or http(s):// URL)", "input")
        return {"type": "input_image", "image_url": p.image_url, "detail": p.detail}
    return {"type": kind, "text": p.text}


def _content(content) -> str | list[dict]:
    """A stored message's content as the chat message's: text joined by newlines, or, when it
    holds images, the chat API's parts in order (``input_image`` -> ``image_url``)."""
    if isinstance(content, str):
        return content
    parts = content or []
    if not any(p.get("type") == "input_image" for p in parts):
        return "\n".join(p.get("text", "") for p in parts)
    return [{"type": "image_url", "image_url": {"url": p["image_url"], "detail": p.get("detail", "auto")}}
            if p.get("type") == "input_image" else {"type": "text", "text": p.get("text", "")} for p in parts]


def chat_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """Stored item dicts (earlier turns, then this input) -> chat messages.  Consecutive
    function calls become one assistant message's ``tool_calls``; reasoning items are not
    replayed (vLLM drops them too: templates strip earlier turns' reasoning)."""
    messages: list[dict] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for it in items:
        kind = it.get("type", "message")
        if kind == "message":
            role = "system" if it["role"] == "developer" else it["role"]
            messages.append({"role": role, "content": _content(it.get("content"))})
        elif kind == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                # The calls of one turn (and the text before them) are one assistant message.
                last["tool_calls"] = [*(last.get("tool_calls") or []), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    if not messages:
        raise bad_request("input is empty: send a string or at least one message item", "input")
    return messages


def function_tools(req: ResponsesRequest) -> list[dict] | None:
    if req.tools is None:
        return None
    tools = []
    for i, t in enumerate(req.tools):
        if t.type != "function":
            log.warning("responses: tool type %r is not served (no tool server); leaving it out", t.type)
            continue
        try:
            fn = FunctionTool.model_validate(t.model_dump())
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            raise bad_request(f"tools[{i}].{'.'.join(map(str, first['loc']))}: {first['msg']}", "tools") from None
        tools.append({"type": "function", "function": fn.model_dump(exclude={"type"}, exclude_none=True)})
    return tools


def _response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("text.format: type json_schema needs a schema", "text")
    spec = {"name": fmt.name or "response", "schema": fmt.schema_}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": spec}


def output_logprobs(req: ResponsesRequest) -> bool:
    """Whether ``output_text`` parts carry logprobs (``include``)."""
    return OUTPUT_LOGPROBS in (req.include or ())


def chat_request(req: ResponsesRequest, messages: list[dict], stream: bool) -> ChatCompletionRequest:
    tools = function_tools(req)
    # The model too: with LoRA serving, it names the adapter the request runs with.
    body: dict = {"model": req.model, "messages": messages, "stream": stream,
                  "parallel_tool_calls": req.parallel_tool_calls}
    if tools:
        body["tools"] = tools
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    elif not isinstance(req.tool_choice, str):
        raise bad_request(f"tool_choice names the function {req.tool_choice.name!r}, but no function tools are "
                          "given", "tool_choice")
    rf = _response_format(req)
    if rf is not None:
        body["response_format"] = rf
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    if output_logprobs(req):
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    elif req.top_logprobs:
        raise bad_request(f"top_logprobs needs include [{OUTPUT_LOGPROBS!r}]", "top_logprobs")
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("seed", "seed"), ("user", "user")):
        value = getattr(req, src)
        if value is not None:
            body[dst] = value
    for name in SAMPLING_EXTRAS:
        if req.model_extra and name in req.model_extra:
            body[name] = req.model_extra[name]
    if stream:
        body["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        loc = [str(x) for x in first.get("loc", ())]
        param = PARAMS.get(loc[0], loc[0]) if loc else None
        raise bad_request(f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}", param) from None


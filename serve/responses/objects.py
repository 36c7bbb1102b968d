"""The Responses API's JSON objects: the response, its output items, its usage, and the stream
events (each with ``type`` and a growing ``sequence_number``)."""

from __future__ import annotations

import json

from serve.responses.convert import new_id
from serve.responses.protocol import ResponsesRequest


def response_object(req: ResponsesRequest, rid: str, model: str, created: int, status: str,
                    output: list[dict], usage: dict | None = None, error: dict | None = None,
                    incomplete_reason: str | None = None) -> dict:
    fmt = {"type": "text"}
    if req.text is not None and req.text.format is not None:
        fmt = req.text.format.model_dump(exclude_none=True, by_alias=True)
    choice = req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "background": req.background,
        "error": error, "incomplete_details": None if incomplete_reason is None else {"reason": incomplete_reason},
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
        "model": model, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
        "store": req.store, "temperature": req.temperature, "text": {"format": fmt}, "tool_choice": choice,
        "tools": [t.model_dump() for t in req.tools or []], "top_p": req.top_p, "truncation": req.truncation,
        "usage": usage, "user": req.user,
    }


def usage(prompt: int, output: int, cached: int, reasoning: int = 0) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": prompt + output}


def message_item(text: str, status: str = "completed", item_id: str | None = None,
                 logprobs: list[dict] | None = None) -> dict:
    content = [] if status == "in_progress" else [output_text(text, logprobs)]
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": content}


def output_text(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def logprob_entries(chat_lp) -> list[dict]:
    """Chat's logprobs (``ChatCompletionLogProbs``, serve/logprobs.py) in OpenAI's Responses
    shape: per token ``token``, ``logprob``, ``bytes`` and ``top_logprobs`` (the same three)."""
    if chat_lp is None or not chat_lp.content:
        return []
    return [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
             "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in e.top_logprobs]}
            for e in chat_lp.content]


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [], "content": content,
            "status": status}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed",
                       item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def final_status(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason) for the engine's finish reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


class EventCounter:
    """Numbers the events of one stream, from 0."""

    def __init__(self):
        self.n = 0

    def frame(self, kind: str, **fields) -> str:
        ev = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return f"data: {json.dumps(ev, ensure_ascii=False, separators=(',', ':'))}\n\n"

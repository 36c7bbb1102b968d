"""``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one tag per call
(Hermes 2 Pro / 3, Qwen2.5 and Qwen3 instruct models)."""

from __future__ import annotations

from serve.tool_parsers.base import MALFORMED, Scan, ToolParser, held_back
from serve.tool_parsers.json_calls import call_from_object
from serve.tool_parsers.json_scan import scan_object, skip_ws
from serve.tool_parsers.registry import ToolParserManager

START, END = "<tool_call>", "</tool_call>"


@ToolParserManager.register_module(["hermes"])
class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (START, END)

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(START)
        if first < 0:
            return Scan(content_end=len(text) - held_back(text, (START,)), started=False)
        scan = Scan(content_end=first, started=True)
        pos = first
        while True:
            j = skip_ws(text, pos + len(START))
            if j >= len(text):
                break
            obj = scan_object(text, j)
            if obj is None:
                scan.calls.append(MALFORMED)
                break
            scan.calls.append(call_from_object(text, obj))
            if obj.end is None:
                break
            close = text.find(END, obj.end)
            nxt = text.find(START, obj.end if close < 0 else close + len(END))
            if nxt < 0:
                break
            pos = nxt
        return scan


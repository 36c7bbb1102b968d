"""``llama3_json``: Llama 3.1+/3.2's JSON tool calls: the output *starts* with
``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), several calls
separated by ``;``.  Anything else is content.  ``arguments`` is accepted for ``parameters``."""

from __future__ import annotations

from serve.tool_parsers.base import MALFORMED, Scan, ToolParser
from serve.tool_parsers.json_calls import call_from_object
from serve.tool_parsers.json_scan import scan_object, skip_ws
from serve.tool_parsers.registry import ToolParserManager

BOT = "<|python_tag|>"


@ToolParserManager.register_module(["llama3_json", "llama4_json"])
class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (BOT,)

    def scan(self, text: str, final: bool) -> Scan:
        j = skip_ws(text, 0)
        if text.startswith(BOT, j):
            j = skip_ws(text, j + len(BOT))
            if j >= len(text):
                return Scan(content_end=0, started=False)  # the tag alone: the call is still to come
        elif j < len(text) and BOT.startswith(text[j:]):
            return Scan(content_end=j, started=False)  # maybe the tag, still arriving
        if j >= len(text):
            return Scan(content_end=len(text), started=False)
        if text[j] != "{":
            return Scan(content_end=len(text), started=False)  # not a call: the output is content
        scan = Scan(content_end=0, started=True)
        while True:
            obj = scan_object(text, j)
            if obj is None:
                scan.calls.append(MALFORMED)
                break
            scan.calls.append(call_from_object(text, obj, ("parameters", "arguments")))
            if obj.end is None:
                break
            k = skip_ws(text, obj.end)
            if k >= len(text) or text[k] != ";":
                break
            j = skip_ws(text, k + 1)
            if j >= len(text) or text[j] != "{":
                break
        return scan

"""``mistral``: Mistral's ``[TOOL_CALLS]`` marker, in either of its two layouts:
``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (tokenizers before v11) or
``[TOOL_CALLS]name[ARGS]{...}``, repeated per call (v11 and later).  Ids are 9 alphanumeric
characters, which Mistral's chat templates require of the ids they read back."""

from __future__ import annotations

import random
import string

from serve.tool_parsers.base import MALFORMED, PartialCall, Scan, ToolParser, held_back
from serve.tool_parsers.json_calls import call_from_object
from serve.tool_parsers.json_scan import scan_object, skip_ws, value_end
from serve.tool_parsers.registry import ToolParserManager

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ALNUM = string.ascii_letters + string.digits


@ToolParserManager.register_module(["mistral"])
class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (BOT, ARGS)

    def make_id(self) -> str:
        return "".join(random.SystemRandom().choice(_ALNUM) for _ in range(9))

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(BOT)
        if first < 0:
            return Scan(content_end=len(text) - held_back(text, (BOT,)), started=False)
        scan = Scan(content_end=first, started=True)
        j = skip_ws(text, first + len(BOT))
        if j >= len(text):
            return scan
        if text[j] == "[":
            self._scan_array(text, j, scan)
        else:
            self._scan_named(text, first, scan)
        return scan

    @staticmethod
    def _scan_array(text: str, j: int, scan: Scan) -> None:
        j = skip_ws(text, j + 1)
        while j < len(text):
            obj = scan_object(text, j)
            if obj is None:
                scan.calls.append(MALFORMED)
                return
            scan.calls.append(call_from_object(text, obj))
            if obj.end is None:
                return
            k = skip_ws(text, obj.end)
            if k >= len(text) or text[k] != ",":
                return
            j = skip_ws(text, k + 1)

    @staticmethod
    def _scan_named(text: str, pos: int, scan: Scan) -> None:
        # pos: at a [TOOL_CALLS]; each call is name[ARGS]{json}.
        while True:
            start = pos + len(BOT)
            a = text.find(ARGS, start)
            if a < 0:
                return  # the name is still being written
            name = text[start:a].strip()
            j = skip_ws(text, a + len(ARGS))
            if not name or (j < len(text) and text[j] != "{"):
                scan.calls.append(MALFORMED)
                return
            end = value_end(text, j) if j < len(text) else None
            args = text[j:end if end is not None else len(text)]
            scan.calls.append(PartialCall(name=name, arguments=args, complete=end is not None))
            if end is None:
                return
            nxt = text.find(BOT, end)
            if nxt < 0:
                return
            pos = nxt

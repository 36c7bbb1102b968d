"""``qwen3_xml`` (also ``qwen3_coder``): Qwen3-Coder's XML-style calls

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; each is converted by the type the request's tool schema gives
that parameter (string stays a string; integer, number, boolean, object, array and null are
read as JSON), and an unknown parameter is read as JSON when it parses, else kept as text.
The arguments object is written one finished parameter at a time, so a stream's fragments
join to exactly the non-streaming arguments."""

from __future__ import annotations

import json

from serve.tool_parsers.base import MALFORMED, PartialCall, Scan, ToolParser, held_back
from serve.tool_parsers.registry import ToolParserManager

START, END = "<tool_call>", "</tool_call>"
FN, FN_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"


@ToolParserManager.register_module(["qwen3_xml", "qwen3_coder"])
class Qwen3XmlToolParser(ToolParser):
    name = "qwen3_xml"
    markers = (START, END)

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(START)
        if first < 0:
            return Scan(content_end=len(text) - held_back(text, (START,)), started=False)
        scan = Scan(content_end=first, started=True)
        pos = first
        while True:
            call, end = self._call(text, pos + len(START))
            if call is None:
                break
            scan.calls.append(call)
            if end is None:
                break
            nxt = text.find(START, end)
            if nxt < 0:
                break
            pos = nxt
        return scan

    def _call(self, text: str, pos: int) -> tuple[PartialCall | None, int | None]:
        """The call whose body starts at ``pos`` and the offset past its ``</function>``."""
        f = text.find(FN, pos)
        if f < 0:
            rest = text[pos:].lstrip()
            return (MALFORMED if rest and not FN.startswith(rest) else None), None
        gt = text.find(">", f + len(FN))
        if gt < 0:
            return None, None  # the name is still being written
        name = text[f + len(FN):gt].strip()
        if not name:
            return MALFORMED, None
        schema = self.tool_schema(name) or {}
        props = schema.get("properties") if isinstance(schema, dict) else None
        props = props if isinstance(props, dict) else {}
        parts: list[str] = []
        i = gt + 1
        while True:
            p = text.find(PARAM, i)
            fe = text.find(FN_END, i)
            if fe >= 0 and (p < 0 or fe < p):
                args = "{" + ", ".join(parts) + "}"
                return PartialCall(name=name, arguments=args, complete=True), fe + len(FN_END)
            if p < 0:
                break
            kgt = text.find(">", p + len(PARAM))
            if kgt < 0:
                break
            key = text[p + len(PARAM):kgt].strip()
            ve = text.find(PARAM_END, kgt + 1)
            if ve < 0:
                break
            value = _strip_newline(text[kgt + 1:ve])
            parts.append(f"{json.dumps(key, ensure_ascii=False)}: "
                         f"{json.dumps(_convert(value, props.get(key)), ensure_ascii=False)}")
            i = ve + len(PARAM_END)
        return PartialCall(name=name, arguments="{" + ", ".join(parts), complete=False), None


def _strip_newline(v: str) -> str:
    if v.startswith("\n"):
        v = v[1:]
    if v.endswith("\n"):
        v = v[:-1]
    return v


def _convert(value: str, prop) -> object:
    """A parameter's text as the JSON value its schema type says."""
    types = prop.get("type") if isinstance(prop, dict) else None
    types = [types] if isinstance(types, str) else list(types or [])
    if "string" in types or (not types and isinstance(prop, dict) and "enum" in prop):
        return value
    if types or not isinstance(prop, dict):
        try:
            parsed = json.loads(value)
        except ValueError:
            if value.strip().lower() in ("true", "false") and "boolean" in types:
                return value.strip().lower() == "true"
            return value
        if types:
            kinds = {"integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list,
                     "null": type(None)}
            ok = any(isinstance(parsed, kinds[t]) and not (t in ("integer", "number") and isinstance(parsed, bool))
                     for t in types if t in kinds)
            return parsed if ok else value
        return parsed
    return value

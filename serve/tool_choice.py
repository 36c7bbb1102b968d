"""``tool_choice``: which calls a request allows, the JSON schema that enforces ``required`` and a
named function, and the parsers that read such constrained output back as ``tool_calls``.

As vLLM: a named function constrains the output to that function's ``parameters`` schema
(the output *is* the arguments); ``required`` constrains it to a JSON array of
``{"name": <one of the tools>, "parameters": <that tool's schema>}`` with at least one item
(at most one when ``parallel_tool_calls`` is false), and no other keys.  The grammar itself is structured
outputs' (``SamplingParams.structured_outputs``); these outputs are read as that JSON, not
through ``--tool-call-parser``.
"""

from __future__ import annotations

from serve.protocol import ChatCompletionNamedToolChoiceParam, ChatCompletionRequest, bad_request
from serve.tool_parsers.base import MALFORMED, PartialCall, Scan, ToolParser
from serve.tool_parsers.json_calls import call_from_object
from serve.tool_parsers.json_scan import scan_object, skip_ws, value_end

_EMPTY_OBJECT = {"type": "object", "properties": {}}


def tool_mode(req: ChatCompletionRequest, auto_enabled: bool) -> str:
    """The request's effective tool choice: "none", "auto", "required" or "named"; a 400 naming
    ``tool_choice`` (or ``tools``) for a combination vLLM refuses."""
    choice = req.tool_choice
    tools = req.tools
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return "none"
    if tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "auto" and not auto_enabled:
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                          "tool_choice")
    if not tools and not isinstance(choice, ChatCompletionNamedToolChoiceParam):
        return "none"  # OpenAI: no tools to call (auto or required) behaves as none
    names = [t.function.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise bad_request(f"tools: function names must be unique; {', '.join(dup)} appears more than once", "tools")
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not in `tools` "
                              f"({', '.join(names)})", "tool_choice")
        return "named"
    return choice


def _parameters(fn) -> dict:
    return fn.parameters if fn.parameters else dict(_EMPTY_OBJECT)


def _hoisted_defs(tools) -> dict:
    """Every tool's ``$defs``, moved to the array schema's root so ``#/$defs/...`` references
    still resolve; two tools defining one name differently is a 400."""
    defs: dict = {}
    for t in tools:
        for name, d in ((t.function.parameters or {}).get("$defs") or {}).items():
            if name in defs and defs[name] != d:
                raise bad_request(f"tools: two functions define $defs.{name} differently", "tools")
            defs[name] = d
    return defs


def tool_choice_schema(req: ChatCompletionRequest, mode: str) -> dict | None:
    """The JSON schema the output must match for ``mode`` ("named", "required"), else None."""
    if mode == "named":
        name = req.tool_choice.function.name
        fn = next(t.function for t in req.tools if t.function.name == name)
        return _parameters(fn)
    if mode != "required":
        return None
    items = []
    for t in req.tools:
        params = {k: v for k, v in _parameters(t.function).items() if k != "$defs"}
        # No other keys: they would be dropped, and a grammar that allows them lets a weak
        # model write keys until max_tokens.
        items.append({"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    defs = _hoisted_defs(req.tools)
    if defs:
        schema["$defs"] = defs
    return schema


class RequiredToolParser(ToolParser):
    """Reads ``[{"name": ..., "parameters": {...}}, ...]`` (``tool_choice: "required"``)."""

    name = "required"

    def scan(self, text: str, final: bool) -> Scan:
        j = skip_ws(text, 0)
        scan = Scan(content_end=0, started=True)
        if j >= len(text):
            return scan
        if text[j] != "[":
            scan.calls.append(MALFORMED)
            return scan
        j = skip_ws(text, j + 1)
        while j < len(text):
            obj = scan_object(text, j)
            if obj is None:
                scan.calls.append(MALFORMED)
                break
            scan.calls.append(call_from_object(text, obj, ("parameters",)))
            if obj.end is None:
                break
            k = skip_ws(text, obj.end)
            if k >= len(text) or text[k] != ",":
                break
            j = skip_ws(text, k + 1)
        return scan


class NamedToolParser(ToolParser):
    """The output is the named function's arguments object."""

    name = "named"

    def __init__(self, function_name: str, tokenizer=None, tools=None):
        super().__init__(tokenizer, tools)
        self.function_name = function_name

    def scan(self, text: str, final: bool) -> Scan:
        j = skip_ws(text, 0)
        scan = Scan(content_end=0, started=True)
        if j >= len(text):
            return scan
        end = value_end(text, j)
        if end is None and final:
            end = len(text.rstrip())
        scan.calls.append(PartialCall(name=self.function_name, arguments=text[j:end if end is not None else len(text)],
                                      complete=end is not None))
        return scan


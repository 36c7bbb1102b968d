"""Shared by the JSON-based parsers: one ``{"name": ..., "arguments": {...}}`` object as a call."""

from __future__ import annotations

import json

from serve.tool_parsers.base import PartialCall
from serve.tool_parsers.json_scan import ObjectScan


def call_from_object(text: str, obj: ObjectScan, args_keys: tuple[str, ...] = ("arguments",)) -> PartialCall:
    """The call an object (possibly unfinished) describes: its name once that string is
    closed, the raw text of its first ``args_keys`` member as written so far."""
    name = None
    if "name" in obj.members:
        s, e = obj.members["name"]
        if e is not None:
            try:
                value = json.loads(text[s:e])
            except ValueError:
                value = None
            name = value if isinstance(value, str) and value else None
    key = next((k for k in args_keys if k in obj.members), None)
    complete = obj.end is not None
    if key is None:
        arguments = "{}" if complete else ""
    else:
        s, e = obj.members[key]
        arguments = text[s:e if e is not None else len(text)]
    return PartialCall(name=name, arguments=arguments, complete=complete)

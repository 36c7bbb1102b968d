"""A scanner for JSON text that may be cut short: where a value starts and, once known, ends.

Tool-call parsers see a model's output a few characters at a time.  They need to know the
function's name as soon as its string closes and the *raw text* of the arguments as it
grows, without re-serialising anything (so that the streamed argument fragments join to
exactly the string a non-streaming response carries).  ``scan_value`` walks one JSON value
from a position and reports, for an object, each member's value span; an end of ``None``
means "not finished yet in this text".  It validates structure only loosely: the text a
parser finally accepts is always checked again with ``json.loads``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_WS = " \t\r\n"


@dataclass
class ObjectScan:
    """One JSON object: ``members`` maps each key whose value has started to its (start, end)
    offsets in the text (end None while that value is unfinished); ``end`` is the offset
    just past the closing brace, None while the object is open."""

    start: int
    members: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


_STRUCTURAL = re.compile(r'["{}\[\]]')


def _string_end(text: str, pos: int) -> int | None:
    """``text[pos]`` is a quote; the offset just past the closing quote, or None."""
    i = pos + 1
    while True:
        q = text.find('"', i)
        if q < 0:
            return None
        k = q - 1
        while text[k] == "\\":  # a quote preceded by an odd number of backslashes is escaped
            k -= 1
        if (q - 1 - k) % 2 == 0:
            return q + 1
        i = q + 1


def value_end(text: str, pos: int) -> int | None:
    """The offset just past the JSON value starting at ``pos`` (a non-space), None when the
    text ends first (or a scalar may still continue)."""
    if pos >= len(text):
        return None
    c = text[pos]
    if c == '"':
        return _string_end(text, pos)
    if c in "{[":
        # Only quotes and brackets matter; jump between them (long arguments stream cheaply).
        depth, i = 0, pos
        while True:
            m = _STRUCTURAL.search(text, i)
            if m is None:
                return None
            i = m.start()
            ch = text[i]
            if ch == '"':
                e = _string_end(text, i)
                if e is None:
                    return None
                i = e
                continue
            depth += 1 if ch in "{[" else -1
            if depth == 0:
                return i + 1
            i += 1
    # A number or a literal (true, false, null): it ends at a delimiter, which must be seen.
    i = pos
    while i < len(text) and text[i] not in _WS + ",}]":
        i += 1
    return i if i < len(text) else None


def scan_object(text: str, pos: int) -> ObjectScan | None:
    """Scans the object whose ``{`` is at ``pos``; None if ``text[pos]`` is not ``{`` or the
    object is malformed (a parser then treats the text as not a tool call)."""
    if pos >= len(text) or text[pos] != "{":
        return None
    scan = ObjectScan(start=pos)
    i = skip_ws(text, pos + 1)
    if i < len(text) and text[i] == "}":
        scan.end = i + 1
        return scan
    while i < len(text):
        if text[i] != '"':
            return None
        kend = _string_end(text, i)
        if kend is None:
            return scan  # the key itself is still being written
        try:
            key = json.loads(text[i:kend])
        except ValueError:
            return None
        i = skip_ws(text, kend)
        if i >= len(text):
            return scan
        if text[i] != ":":
            return None
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return scan
        vend = value_end(text, i)
        scan.members[key] = (i, vend)
        if vend is None:
            return scan
        i = skip_ws(text, vend)
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != ",":
            return None
        i = skip_ws(text, i + 1)
    return scan

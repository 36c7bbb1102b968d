"""The tool-call parser interface, and the one streaming driver every parser shares.

A parser turns a model's raw output into OpenAI ``tool_calls`` (vLLM's ``ToolParser``): one
instance per choice of one request, so per-request state never mixes.  Each parser writes a
single function, ``scan(text, final)``, that says where the content ends and what calls the
text holds *so far*: each call's name once it is complete, and its arguments as the raw
JSON text written so far, which only ever grows.  From that one function come both
answers:

- ``extract_tool_calls(text)``: the whole output at once (a non-streaming response);
- ``extract_tool_calls_streaming(delta)`` then ``finish_streaming()``: the same output fed
  in arbitrary pieces, returning OpenAI-shaped deltas: content while it cannot be the
  start of a tool call (a partial tag is held back, never sent as content), then per call
  a first delta with id, type and name and then argument fragments.

Because both come from the same scan, the joined deltas equal the non-streaming result for
every way of cutting the text (the parser tests check every split point).  An output that
does not parse as tool calls is content, as in vLLM; when a stream has already sent a
call's name by then, it cannot be taken back.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import ClassVar


def random_tool_call_id() -> str:
    """vLLM's form of a tool call id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """The arguments as JSON text (an object), as the model wrote it."""

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass(frozen=True)
class ToolCallDelta:
    """One entry of a streamed ``delta.tool_calls``: the first for a call has id and name
    (and empty arguments), the later ones only argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        d: dict = {"index": self.index}
        if self.id is not None:
            d["id"] = self.id
            d["type"] = "function"
        fn: dict = {}
        if self.name is not None:
            fn["name"] = self.name
        fn["arguments"] = self.arguments
        d["function"] = fn
        return d


@dataclass(frozen=True)
class StreamDelta:
    """One streamed piece: content text, or tool-call deltas (never both)."""

    content: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass
class PartialCall:
    name: str | None
    """The function's name once it is fully written, else None."""
    arguments: str
    """The raw argument JSON written so far; a later scan's value always extends this one.
    "{}" once the call is complete without arguments."""
    complete: bool
    """The call's text is finished (its arguments are whole)."""


MALFORMED = PartialCall(name=None, arguments="", complete=False)
"""A call whose text cannot be one: a stream waits on it, and the output ends up content."""


@dataclass
class Scan:
    content_end: int
    """``text[:content_end]`` is content.  Before any call started, text past it may still
    become a tag (held back while streaming)."""
    started: bool
    """A tool-call region begins at ``content_end``."""
    calls: list[PartialCall] = field(default_factory=list)


@dataclass
class _SentCall:
    id: str
    args_len: int = 0


class ToolParser:
    """Base class: subclasses set ``name`` and implement ``scan``."""

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()
    """The tags the parser looks for; when the tokenizer has any as a special token, the
    request keeps special tokens in its text (see ``needs_special_tokens``)."""

    def __init__(self, tokenizer=None, tools: list[dict] | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or []
        self._text = ""
        self._content_sent = 0
        self._sent: list[_SentCall] = []

    @classmethod
    def needs_special_tokens(cls, tokenizer) -> bool:
        """Whether a marker is a special token of ``tokenizer``, which the detokenizer drops
        unless the request sets ``skip_special_tokens=False`` (vLLM's ``adjust_request``)."""
        if tokenizer is None:
            return False
        special = set(getattr(tokenizer, "all_special_tokens", None) or ())
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        special |= {str(t) for t in decoder.values() if getattr(t, "special", False)}
        return any(m in special for m in cls.markers)

    # ------------------------------------------------------------------ subclass API

    def scan(self, text: str, final: bool) -> Scan:
        """Where content ends and which calls ``text`` holds; ``final``: no more text follows."""
        raise NotImplementedError

    def make_id(self) -> str:
        return random_tool_call_id()

    def tool_schema(self, name: str) -> dict | None:
        """The ``parameters`` schema of the request's function ``name`` (None if unknown)."""
        for t in self.tools:
            fn = t.get("function") or {}
            if fn.get("name") == name:
                return fn.get("parameters")
        return None

    # ------------------------------------------------------------------ whole output

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        s = self.scan(text, final=True)
        calls = self._accepted(s)
        if calls is None:
            return ExtractedToolCalls(False, [], text)
        content = text[:s.content_end].rstrip() or None
        return ExtractedToolCalls(True, [ToolCall(self.make_id(), c.name, c.arguments) for c in calls], content)

    @staticmethod
    def _accepted(s: Scan) -> list[PartialCall] | None:
        """The calls of a final scan when every one is whole, named, with an object for
        arguments; None otherwise (the output is then content)."""
        if not s.started or not s.calls:
            return None
        for c in s.calls:
            if c.name is None or not c.complete:
                return None
            try:
                args = json.loads(c.arguments)
            except ValueError:
                return None
            if not isinstance(args, dict):
                return None
        return s.calls

    # ------------------------------------------------------------------ streaming

    @property
    def streamed_tool_calls(self) -> bool:
        """Whether this stream has sent at least one tool call (finish_reason "tool_calls")."""
        return bool(self._sent)

    def extract_tool_calls_streaming(self, delta_text: str) -> list[StreamDelta]:
        """Feeds the next piece of output; returns the deltas it completes."""
        self._text += delta_text
        return self._advance(final=False)

    def finish_streaming(self) -> list[StreamDelta]:
        """The output ended: flushes what was held back."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[StreamDelta]:
        text = self._text
        s = self.scan(text, final)
        out: list[StreamDelta] = []
        if not s.started:
            # Trailing whitespace is held back too: if a call follows, the content is stripped.
            content = text if final else text[:s.content_end].rstrip()
        else:
            content = text[:s.content_end].rstrip()
        if final and not self._sent and self._accepted(s) is None:
            content = text  # not tool calls after all: the whole output is content, as unstreamed
        if len(content) > self._content_sent:
            out.append(StreamDelta(content=content[self._content_sent:]))
            self._content_sent = len(content)
        if not s.started or (final and not self._sent and self._accepted(s) is None):
            return out
        for i, call in enumerate(s.calls):
            if call.name is None:
                break  # calls are sent in order: a later one waits for this name
            if i == len(self._sent):
                sent = _SentCall(self.make_id())
                self._sent.append(sent)
                out.append(StreamDelta(tool_calls=(ToolCallDelta(index=i, id=sent.id, name=call.name),)))
            sent = self._sent[i]
            if len(call.arguments) > sent.args_len:
                out.append(StreamDelta(tool_calls=(ToolCallDelta(index=i, arguments=call.arguments[sent.args_len:]),)))
                sent.args_len = len(call.arguments)
        return out


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of a marker: text
    that may yet become a tag, so a stream must not send it as content."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best

"""One chat choice's output -> reasoning, content and tool calls, whole or streamed.

The reasoning parser (``--reasoning-parser``) runs first; what it leaves as content goes to
the tool-call parser the request's tool choice picks: ``--tool-call-parser`` for "auto",
the JSON readers of ``serve/tool_choice.py`` for "required" and a named function, none for
"none".  The streamed pieces are the same parsers' streaming answers, so a stream's
joined deltas equal the non-streaming message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve.protocol import DeltaMessage
from serve.reasoning.base import ReasoningParser
from serve.tool_parsers.base import ToolParser


@dataclass
class ParsedMessage:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict] = field(default_factory=list)


class ChoiceParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, parallel_tool_calls: bool = True):
        self.reasoning = reasoning
        self.tools = tools
        self.parallel = parallel_tool_calls

    # ------------------------------------------------------------------ whole output

    def parse(self, text: str) -> ParsedMessage:
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(text)
        if self.tools is None or content is None:
            return ParsedMessage(content=content, reasoning=reasoning)
        got = self.tools.extract_tool_calls(content)
        if not got.tools_called:
            return ParsedMessage(content=got.content, reasoning=reasoning)
        calls = got.tool_calls if self.parallel else got.tool_calls[:1]
        return ParsedMessage(content=got.content, reasoning=reasoning, tool_calls=[c.to_openai() for c in calls])

    # ------------------------------------------------------------------ streaming

    @property
    def tools_called(self) -> bool:
        return self.tools is not None and self.tools.streamed_tool_calls

    def feed(self, delta_text: str, final: bool) -> list[DeltaMessage]:
        """The deltas the next piece of output completes (all of them when ``final``)."""
        out: list[DeltaMessage] = []
        content_parts: list[str] = []
        if self.reasoning is not None:
            pieces = [self.reasoning.extract_reasoning_streaming(delta_text)] if delta_text else []
            if final:
                pieces.append(self.reasoning.finish_streaming())
            for p in pieces:
                if p is None:
                    continue
                if p.reasoning:
                    out.append(DeltaMessage(reasoning=p.reasoning))
                if p.content:
                    content_parts.append(p.content)
        elif delta_text:
            content_parts.append(delta_text)
        content = "".join(content_parts)
        if self.tools is None:
            if content:
                out.append(DeltaMessage(content=content))
            return out
        deltas = self.tools.extract_tool_calls_streaming(content) if content else []
        if final:
            deltas += self.tools.finish_streaming()
        for d in deltas:
            if d.content:
                out.append(DeltaMessage(content=d.content))
            calls = [c.to_openai() for c in d.tool_calls if self.parallel or c.index == 0]
            if calls:
                out.append(DeltaMessage(tool_calls=calls))
        return out

"""Tool-call parsers: a model's raw output -> OpenAI ``tool_calls`` (``--tool-call-parser``).

``base.ToolParser`` is the interface (whole output and streamed deltas from one scan);
``registry.ToolParserManager`` finds a parser by name and loads ``--tool-parser-plugin``
files.  Built in: hermes, llama3_json (llama4_json), mistral, qwen3_xml (qwen3_coder).
"""

from serve.tool_parsers.base import (ExtractedToolCalls, PartialCall, Scan, StreamDelta, ToolCall, ToolCallDelta,
                                     ToolParser, random_tool_call_id)
from serve.tool_parsers.registry import ToolParserManager

__all__ = ["ExtractedToolCalls", "PartialCall", "Scan", "StreamDelta", "ToolCall", "ToolCallDelta", "ToolParser",
           "ToolParserManager", "random_tool_call_id"]

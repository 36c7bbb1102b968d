"""Tool-call parsers by name (``--tool-call-parser NAME``) and plugins (``--tool-parser-plugin``).

As vLLM's ``ToolParserManager``: a parser class registers itself under one or more names
with the ``register_module`` decorator; a plugin is a Python file that does the same for
its own classes, loaded once at server start.
"""

from __future__ import annotations

from typing import ClassVar

from serve.parser_registry import ParserManager, load_plugin


class ToolParserManager(ParserManager):
    parsers: ClassVar[dict[str, type]] = {}
    kind = "tool parser"
    flag = "--tool-call-parser"
    package = "serve.tool_parsers"
    builtins = ("hermes", "llama3_json", "mistral", "qwen3_xml")

    @classmethod
    def base_class(cls) -> type:
        from serve.tool_parsers.base import ToolParser
        return ToolParser

    @classmethod
    def get_tool_parser(cls, name: str) -> type:
        return cls.get(name)

    @classmethod
    def import_tool_parser(cls, path: str) -> None:
        """Runs the plugin file at ``path`` (which registers its parsers)."""
        load_plugin(path, "--tool-parser-plugin")

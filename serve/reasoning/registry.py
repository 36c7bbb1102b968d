"""Reasoning parsers by name (``--reasoning-parser NAME``), as vLLM's ``ReasoningParserManager``;
a plugin file (:meth:`ReasoningParserManager.import_reasoning_parser`) registers more."""

from __future__ import annotations

from typing import ClassVar

from serve.parser_registry import ParserManager, load_plugin


class ReasoningParserManager(ParserManager):
    parsers: ClassVar[dict[str, type]] = {}
    kind = "reasoning parser"
    flag = "--reasoning-parser"
    package = "serve.reasoning"
    builtins = ("think",)

    @classmethod
    def base_class(cls) -> type:
        from serve.reasoning.base import ReasoningParser
        return ReasoningParser

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type:
        return cls.get(name)

    @classmethod
    def import_reasoning_parser(cls, path: str) -> None:
        load_plugin(path, "--reasoning-parser-plugin")

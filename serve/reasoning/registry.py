"""Reasoning parsers by name (``--reasoning-parser NAME``), as vLLM's ``ReasoningParserManager``;
``--reasoning-parser-plugin FILE`` loads a Python file that registers more."""

from __future__ import annotations

import importlib
from typing import Callable, ClassVar

_BUILTIN_MODULES = ("think",)


class ReasoningParserManager:
    parsers: ClassVar[dict[str, type]] = {}
    """name -> parser class, shared by the process (a plugin adds to it)."""

    @classmethod
    def register_module(cls, name: str | list[str] | None = None, force: bool = True,
                        module: type | None = None) -> Callable | type:
        def register(klass: type) -> type:
            from serve.reasoning.base import ReasoningParser
            if not (isinstance(klass, type) and issubclass(klass, ReasoningParser)):
                raise TypeError(f"a reasoning parser must subclass serve.reasoning.ReasoningParser, got {klass!r}")
            names = [name] if isinstance(name, str) else list(name or [klass.name or klass.__name__])
            for n in names:
                if not force and n in cls.parsers:
                    raise KeyError(f"reasoning parser {n!r} is already registered")
                cls.parsers[n] = klass
            return klass

        if module is not None:
            return register(module)
        return register

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type:
        _load_builtins()
        if name not in cls.parsers:
            raise KeyError(f"--reasoning-parser {name!r} is not registered; known parsers: "
                           f"{', '.join(sorted(cls.parsers))}")
        return cls.parsers[name]

    @classmethod
    def names(cls) -> list[str]:
        _load_builtins()
        return sorted(cls.parsers)

    @classmethod
    def import_reasoning_parser(cls, path: str) -> None:
        from serve.tool_parsers.registry import load_plugin
        load_plugin(path, "--reasoning-parser-plugin")


def _load_builtins() -> None:
    for m in _BUILTIN_MODULES:
        importlib.import_module(f"serve.reasoning.{m}")

"""Tool-call parsers by name (``--tool-call-parser NAME``) and plugins (``--tool-parser-plugin``).

As vLLM's ``ToolParserManager``: a parser class registers itself under one or more names
with the ``register_module`` decorator; a plugin is a Python file that does the same for
its own classes, loaded once at server start.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Callable, ClassVar

_BUILTIN_MODULES = ("hermes", "llama3_json", "mistral", "qwen3_xml")


class ToolParserManager:
    parsers: ClassVar[dict[str, type]] = {}
    """name -> parser class, shared by the process (a plugin adds to it)."""

    @classmethod
    def register_module(cls, name: str | list[str] | None = None, force: bool = True,
                        module: type | None = None) -> Callable | type:
        """Registers ``module`` (a ToolParser subclass) under ``name`` (default: its ``name``
        attribute); usable as ``@ToolParserManager.register_module("mine")``."""
        def register(klass: type) -> type:
            from serve.tool_parsers.base import ToolParser
            if not (isinstance(klass, type) and issubclass(klass, ToolParser)):
                raise TypeError(f"a tool parser must subclass serve.tool_parsers.ToolParser, got {klass!r}")
            names = [name] if isinstance(name, str) else list(name or [klass.name or klass.__name__])
            for n in names:
                if not force and n in cls.parsers:
                    raise KeyError(f"tool parser {n!r} is already registered")
                cls.parsers[n] = klass
            return klass

        if module is not None:
            return register(module)
        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type:
        _load_builtins()
        if name not in cls.parsers:
            raise KeyError(f"--tool-call-parser {name!r} is not registered; known parsers: "
                           f"{', '.join(sorted(cls.parsers))}")
        return cls.parsers[name]

    @classmethod
    def names(cls) -> list[str]:
        _load_builtins()
        return sorted(cls.parsers)

    @classmethod
    def import_tool_parser(cls, path: str) -> None:
        """Runs the plugin file at ``path`` (which registers its parsers)."""
        load_plugin(path, "--tool-parser-plugin")


def load_plugin(path: str, flag: str) -> None:
    """Executes the Python file ``path`` as a module; ValueError naming ``flag`` when it cannot."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r}: no such file")
    mod_name = "jaxllm_plugin_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{flag} {path!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise ValueError(f"{flag} {path!r} failed to load: {type(e).__name__}: {e}") from e


def _load_builtins() -> None:
    for m in _BUILTIN_MODULES:
        importlib.import_module(f"serve.tool_parsers.{m}")

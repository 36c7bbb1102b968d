"""What the tool-call and reasoning parser registries share (vLLM's ``ToolParserManager`` /
``ReasoningParserManager``): parser classes registered by name with a decorator, the built-in
modules imported on first lookup, and plugins (a Python file that registers its own classes)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Callable, ClassVar


class ParserManager:
    """A registry of parser classes; each subclass has its own ``parsers`` and names."""

    parsers: ClassVar[dict[str, type]]
    """name -> parser class, shared by the process (a plugin adds to it)."""
    kind: ClassVar[str]       # "tool parser"
    flag: ClassVar[str]       # the CLI flag that names one
    package: ClassVar[str]    # where the built-in parsers live
    builtins: ClassVar[tuple[str, ...]]

    @classmethod
    def base_class(cls) -> type:
        raise NotImplementedError

    @classmethod
    def register_module(cls, name: str | list[str] | None = None, force: bool = True,
                        module: type | None = None) -> Callable | type:
        """Registers ``module`` (a subclass of :meth:`base_class`) under ``name`` (default: its
        ``name`` attribute); usable as a decorator, ``@Manager.register_module("mine")``."""
        def register(klass: type) -> type:
            base = cls.base_class()
            if not (isinstance(klass, type) and issubclass(klass, base)):
                raise TypeError(f"a {cls.kind} must subclass {base.__module__}.{base.__name__}, got {klass!r}")
            names = [name] if isinstance(name, str) else list(name or [klass.name or klass.__name__])
            for n in names:
                if not force and n in cls.parsers:
                    raise KeyError(f"{cls.kind} {n!r} is already registered")
                cls.parsers[n] = klass
            return klass

        if module is not None:
            return register(module)
        return register

    @classmethod
    def get(cls, name: str) -> type:
        cls._load_builtins()
        if name not in cls.parsers:
            raise KeyError(f"{cls.flag} {name!r} is not registered; known parsers: {', '.join(sorted(cls.parsers))}")
        return cls.parsers[name]

    @classmethod
    def names(cls) -> list[str]:
        cls._load_builtins()
        return sorted(cls.parsers)

    @classmethod
    def _load_builtins(cls) -> None:
        for m in cls.builtins:
            importlib.import_module(f"{cls.package}.{m}")


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

"""How a test starts a probe: a module of tests/support/ run in its own process (a device count
or a cluster fixed before JAX starts), as ``python -m support.<name>``, with the repository
and tests/ importable exactly as they are under pytest."""

from __future__ import annotations

import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)


def probe_command(name: str, *args) -> list[str]:
    """argv that runs ``support/<name>.py`` with ``args``."""
    return [sys.executable, "-m", f"support.{name}", *map(str, args)]


def probe_env(base: dict | None = None, **extra: str) -> dict:
    """``base`` (default: this process's environment) plus ``extra``, with the repository root
    and tests/ first on PYTHONPATH."""
    env = {**(os.environ if base is None else base), **extra}
    paths = [ROOT, TESTS] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env

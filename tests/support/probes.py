"""How a test starts a probe: a module of tests/support/ run in its own process (a device count
or a cluster fixed before JAX starts), as ``python -m support.<name>``, with the repository
and tests/ importable exactly as they are under pytest."""

from __future__ import annotations

import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)

# What the suite adds to XLA_FLAGS (tests/conftest.py): the LLVM back end at -O0, which compiles
# the tests' tiny programs faster and computes the same values (no fast-math at any level); and
# XLA CPU's classic elemental fusion emitter instead of its MLIR fusion emitters, whose pass
# pipelines were half of an engine's compile CPU time (the tiny Llama's 4-bucket warm-up
# 15-16 -> 7.5 CPU-s).  Both are code generators for the same HLO; the suite's oracles
# (transformers, the XLA reference paths) bound what the programs compute either way.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def with_test_xla_flags(flags: str, inherited: str = "") -> str:
    """``flags`` (an XLA_FLAGS value) with :data:`TEST_XLA_FLAGS` appended where it does not
    already set them (a flag the caller set wins), each as ``inherited`` (the XLA_FLAGS of the
    process that starts the probe) sets it where it does."""
    parts = flags.split()
    names = {p.split("=", 1)[0] for p in parts}
    given = {p.split("=", 1)[0]: p for p in inherited.split()}
    return " ".join(parts + [given.get(name, f) for f in TEST_XLA_FLAGS
                             if (name := f.split("=", 1)[0]) not in names])


def probe_command(name: str, *args) -> list[str]:
    """argv that runs ``support/<name>.py`` with ``args``."""
    return [sys.executable, "-m", f"support.{name}", *map(str, args)]


def probe_env(base: dict | None = None, **extra: str) -> dict:
    """``base`` (default: this process's environment) plus ``extra``, with the repository root
    and tests/ first on PYTHONPATH and the suite's XLA flags kept in an ``XLA_FLAGS`` that
    ``extra`` or ``base`` sets (a probe's device count)."""
    base = os.environ if base is None else base
    env = {**base, **extra}
    env["XLA_FLAGS"] = with_test_xla_flags(env.get("XLA_FLAGS", ""), base.get("XLA_FLAGS", ""))
    paths = [ROOT, TESTS] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def production_env(base: dict | None = None) -> dict:
    """:func:`probe_env` without :data:`TEST_XLA_FLAGS`: XLA's own defaults (optimized LLVM code,
    the MLIR fusion emitters), what a user's process compiles with."""
    env = probe_env(base)
    names = {f.split("=", 1)[0] for f in TEST_XLA_FLAGS}
    env["XLA_FLAGS"] = " ".join(p for p in env["XLA_FLAGS"].split() if p.split("=", 1)[0] not in names)
    return env

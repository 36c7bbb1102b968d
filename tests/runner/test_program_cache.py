"""Saved compiled programs: a round trip runs and gives the same result without tracing, the
key follows everything that decides the program, what JAX's persistent cache loaded is not
saved (its copy would not run), and a damaged file is compiled again, not trusted."""

from __future__ import annotations

import logging
import os
import random

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import default_cache_dir
from jaxllm.runner import compile as cc
from jaxllm.runner import program_cache
from jaxllm.runner.program_cache import ProgramCache, describe_args

X = jax.ShapeDtypeStruct((4, 8), jnp.float32)


def _lowered(scale: float):
    return jax.jit(lambda a, b: (a * scale) @ b.T).lower(X, X)


def _check_runs(compiled, scale):
    a = np.arange(32, dtype=np.float32).reshape(4, 8)
    b = np.ones((4, 8), np.float32)
    np.testing.assert_allclose(np.asarray(compiled(jnp.asarray(a), jnp.asarray(b))), (a * scale) @ b.T, rtol=1e-6)


def test_round_trip_runs_without_tracing(tmp_path):
    cc.enable_persistent_cache(os.path.join(default_cache_dir(), "xla"))   # as an engine runs
    cc.install_listeners()
    scale = random.random()     # a program JAX's persistent cache has never seen
    cache = ProgramCache(str(tmp_path), jax.devices()[:1])
    key = cache.key(f"test|scale={scale}")
    assert not cache.has(key) and cache.load(key) is None
    _check_runs(cache.compile(key, lambda: _lowered(scale)), scale)
    assert cache.has(key)
    before = cc.counts()
    loaded = ProgramCache(str(tmp_path), jax.devices()[:1]).load(key)
    assert cc.counts()["traces"] == before["traces"] and cc.counts()["cache_misses"] == before["cache_misses"]
    _check_runs(loaded, scale)
    # The same program under a key the program cache lacks: JAX's persistent cache has it,
    # and what that loads would not run once saved, so it is not saved.
    other = ProgramCache(str(tmp_path / "other"), jax.devices()[:1])
    hits = cc.counts()["cache_hits"]
    _check_runs(other.compile(key, lambda: _lowered(scale)), scale)
    assert cc.counts()["cache_hits"] > hits, "precondition: a persistent-cache hit"
    assert not other.has(key), "an executable loaded by JAX's persistent cache was saved"


def test_key_follows_the_description_and_the_source(tmp_path, monkeypatch):
    devices = jax.devices()[:1]
    cache = ProgramCache(str(tmp_path), devices)
    assert cache.key("a") == ProgramCache(str(tmp_path), devices).key("a")
    assert cache.key("a") != cache.key("b")
    assert describe_args(X) != describe_args(jax.ShapeDtypeStruct((4, 9), jnp.float32))
    assert describe_args(X) != describe_args(jax.ShapeDtypeStruct((4, 8), jnp.bfloat16))
    assert describe_args((X, X)) != describe_args([X, X])
    # An edit to jaxllm's source makes every key new.
    monkeypatch.setattr(program_cache, "source_digest", lambda: "edited")
    assert ProgramCache(str(tmp_path), devices).key("a") != cache.key("a")


def test_a_damaged_file_is_not_trusted(tmp_path, caplog):
    scale = random.random()
    cache = ProgramCache(str(tmp_path), jax.devices()[:1])
    key = cache.key(f"test|damaged|{scale}")
    cache.compile(key, lambda: _lowered(scale))
    path = os.path.join(str(tmp_path), f"{key}.jaxexe")
    assert os.path.isfile(path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with caplog.at_level(logging.WARNING, logger="jaxllm.cache"):
        assert cache.load(key) is None
    assert "compiling it again" in caplog.text
    assert not ProgramCache(None, jax.devices()[:1]).has(key)   # no folder: nothing saved or loaded


_LAPACK_PROGRAM = """
import sys, jax, jax.numpy as jnp, numpy as np
from jaxllm.runner.program_cache import ProgramCache
root, scale, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
a = np.tril(np.full((8, 8), scale, np.float32), -1) + np.eye(8, dtype=np.float32)
b = np.arange(16, dtype=np.float32).reshape(8, 2)
cache = ProgramCache(root, jax.devices()[:1])
key = cache.key(f"lapack|scale={scale}")
if mode == "save":
    lower = lambda: jax.jit(lambda a, b: jax.lax.linalg.triangular_solve(  # noqa: E731
        a, b, left_side=True, lower=True, unit_diagonal=True)).lower(a, b)
    cache.compile(key, lower)
    assert cache.has(key), "precondition: the program was saved"
else:
    got = np.asarray(cache.load(key)(jnp.asarray(a), jnp.asarray(b)))
    np.testing.assert_allclose(got, np.linalg.solve(a.astype(np.float64), b), rtol=1e-4, atol=1e-4)
    print("ran")
"""


def test_a_loaded_program_that_calls_lapack_runs_in_a_fresh_process(tmp_path):
    """A GDN layer's chunked prefill solves triangular systems (LAPACK on XLA:CPU, a kernel
    jaxlib readies only when it lowers such a call): a process that loads the program
    without lowering anything crashed when it ran it (a hybrid model's second start)."""
    import subprocess
    import sys
    scale = random.random()      # a program JAX's persistent cache has never seen: really compiled
    run = [sys.executable, "-c", _LAPACK_PROGRAM, str(tmp_path), str(scale)]
    saved = subprocess.run([*run, "save"], capture_output=True, text=True, timeout=300)
    assert saved.returncode == 0, saved.stderr[-3000:]
    loaded = subprocess.run([*run, "load"], capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0 and "ran" in loaded.stdout, (loaded.returncode, loaded.stderr[-3000:])

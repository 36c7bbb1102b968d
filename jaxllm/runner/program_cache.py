"""Compiled step programs saved whole, so that a second start neither traces nor compiles.

JAX's persistent compilation cache is keyed by the lowered program, so a warm start still
traces and lowers every bucket before it can look one up: ~0.5 s a bucket for the built-in
model's 30 unrolled layers, 8 s of a 16-program start.  Here each compiled program is
serialized (``jax.experimental.serialize_executable``) under a key made of everything that
decides what the program is, and a later start loads it without tracing (~0.2 s).

The key is a digest of: jaxllm's own source (every .py and native kernel source), the
versions of jax, jaxlib and numpy, the backend, its devices and ``XLA_FLAGS``, and the
program's description (its static configuration and the shape, dtype and sharding of every
argument).  A change to any of them is a different key; a file that fails to load is
compiled again and replaced (``jaxllm/cache_files.py``).  JAX's persistent cache stays underneath, for programs whose
lowering did not change when the key did (what it loads is not saved here: :meth:`compile`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable as se

from jaxllm import cache_files
from jaxllm.runner import compile as cc

log = logging.getLogger("jaxllm.runner")

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SOURCE_SUFFIXES = (".py", ".cc", ".h")
# A program file: this magic, the SHA-256 of the rest, then the pickled serialized executable.
_MAGIC = b"jaxllm-program-1\n"


@functools.cache
def source_digest() -> str:
    """A digest of jaxllm's source files: any edit to the engine makes every key new."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(_PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(_SOURCE_SUFFIXES):
                path = os.path.join(root, name)
                h.update(os.path.relpath(path, _PACKAGE).encode())
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _environment(devices) -> str:
    backend = devices[0].client
    return "|".join([
        source_digest(), jax.__version__, jaxlib.__version__, np.__version__,
        backend.platform, backend.platform_version,
        ",".join(f"{d.id}:{d.device_kind}:{d.process_index}" for d in devices),
        f"processes={jax.process_count()}", os.environ.get("XLA_FLAGS", ""),
        f"x64={jax.config.jax_enable_x64}", f"precision={jax.config.jax_default_matmul_precision}",
    ])


def describe_args(*args) -> str:
    """The structure, shapes, dtypes and shardings of a program's arguments."""
    def leaf(x):
        sharding = getattr(x, "sharding", None)
        spec = getattr(sharding, "spec", None)
        return f"{tuple(x.shape)}:{x.dtype}:{spec}"
    leaves, tree = jax.tree_util.tree_flatten(args)
    return f"{tree}|" + ",".join(leaf(x) for x in leaves)


@functools.cache
def _prepare_cpu_runtime() -> None:
    """Readies the LAPACK kernels jaxlib registers lazily, when a program calling one is first
    lowered: a loaded program is never lowered, and on XLA:CPU one that calls an uninitialised
    kernel (the GDN prefill's ``triangular_solve``: ``lapack_strsm_ffi``) crashes the process
    when run.  Lowering one such call (nothing compiles; once per process, before any load)
    initialises them all."""
    one = np.ones((1, 1), np.float32)
    jax.jit(lambda a, b: jax.lax.linalg.triangular_solve(a, b, left_side=True, lower=True)).lower(one, one)


class ProgramCache:
    """Serialized executables under ``root``, keyed by :meth:`key`; ``root=None`` keeps none."""

    def __init__(self, root: str | None, devices):
        self.root = root
        self.devices = list(devices)
        self._env = _environment(self.devices)
        if root is not None and self.devices[0].platform == "cpu":
            _prepare_cpu_runtime()

    def key(self, description: str) -> str:
        return hashlib.sha256(f"{self._env}\n{description}".encode()).hexdigest()[:32]

    def _path(self, key: str) -> str:
        return os.path.join(self.root, f"{key}.jaxexe")

    def has(self, key: str) -> bool:
        return self.root is not None and os.path.isfile(self._path(key))

    def load(self, key: str):
        """The compiled program saved under ``key``, or None (absent; or damaged, truncated or
        written by another jaxlib: then removed, with one log line, and compiled again)."""
        if not self.has(key):
            return None
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
            head = len(_MAGIC) + 32
            # The digest is checked before unpickling: garbage never reaches the deserializer.
            if data[:len(_MAGIC)] != _MAGIC:
                raise ValueError("not a jaxllm program file")
            if hashlib.sha256(data[head:]).digest() != data[len(_MAGIC):head]:
                raise ValueError(f"{len(data)} bytes that do not match their digest")
            payload, in_tree, out_tree = pickle.loads(data[head:])
            return se.deserialize_and_load(payload, in_tree, out_tree, backend=self.devices[0].client,
                                           execution_devices=self.devices)
        except Exception as e:  # a truncated file, another jaxlib's format: compile it again
            cache_files.discard(path, f"{type(e).__name__}: {e}", "compiling it again")
            return None

    def compile(self, key: str, lower):
        """``lower().compile()`` (through JAX's persistent cache), saved under ``key`` when XLA
        really compiled it.  An executable that JAX's persistent cache loaded serializes
        without its code on XLA:CPU (the copy fails with "Function ... not found" when run),
        so such a hit is not saved (and JAX offers no per-compile way around its cache: its
        switch is read once per process)."""
        hits = cc.thread_cache_hits()
        compiled = lower().compile()
        if cc.thread_cache_hits() == hits:
            self._store(key, compiled)
        return compiled

    def _store(self, key: str, compiled) -> None:
        """Saves ``compiled`` under ``key`` (atomically; a program that cannot be serialized is skipped)."""
        if self.root is None:
            return
        try:
            blob = pickle.dumps(se.serialize(compiled))
        except Exception as e:
            log.debug("program %s not saved: %s", key, e)
            return
        os.makedirs(self.root, exist_ok=True)
        try:
            cache_files.atomic_write(self._path(key), _MAGIC + hashlib.sha256(blob).digest() + blob)
        except OSError as e:
            log.warning("cannot save a compiled program under %s: %s", self.root, e)

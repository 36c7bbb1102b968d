"""Ahead-of-time compilation support: the persistent cache and the compile guard.

JAX reports tracing, XLA compilation and persistent-cache lookups through
``jax.monitoring``; one process-wide listener counts them, and the runner compares the
counts around every step after warm-up.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter

import jax
try:   # private: how JAX reads an entry; a JAX that moved it skips the check, never fails a start
    from jax._src.compilation_cache import decompress_executable
except ImportError:   # pragma: no cover
    decompress_executable = None

from jaxllm import cache_files

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_MISS_EVENT = "/jax/compilation_cache/cache_misses"

# JAX's cache entry files end so (jax/_src/lru_cache.py); the list of checked ones.
_JAX_ENTRY_SUFFIX = "-cache"
_VERIFIED = "jaxllm-verified.json"

_counts: Counter = Counter()
_lock = threading.Lock()
_installed = False
_thread = threading.local()   # persistent-cache hits of the calling thread (JAX records them there)


def _on_event(event: str, **_):
    with _lock:
        _counts[event] += 1
    if event == CACHE_HIT_EVENT:
        _thread.cache_hits = getattr(_thread, "cache_hits", 0) + 1


def thread_cache_hits() -> int:
    """Persistent-cache hits so far in this thread: tells a real compile from a cache load."""
    return getattr(_thread, "cache_hits", 0)


def _on_duration(event: str, duration: float, **_):
    with _lock:
        _counts[event] += 1


def install_listeners() -> None:
    global _installed
    if not _installed:
        jax.monitoring.register_event_listener(_on_event)
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _installed = True


def counts() -> dict[str, int]:
    """Snapshot of traces, backend compiles and persistent-cache hits/misses so far."""
    with _lock:
        return {"traces": _counts[TRACE_EVENT], "compiles": _counts[COMPILE_EVENT],
                "cache_hits": _counts[CACHE_HIT_EVENT], "cache_misses": _counts[CACHE_MISS_EVENT]}


def _jax_entry_problem(path: str) -> str | None:
    """Why an entry of JAX's compilation cache cannot be read, or None: JAX's own check of an
    entry (``compilation_cache.decompress_executable``) runs when it looks the entry up."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        if len(decompress_executable(data)) <= 8:   # 8 bytes of compile time first
            return "empty"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def check_persistent_cache(cache_dir: str) -> None:
    """Removes the entries of JAX's compilation cache under ``cache_dir`` that cannot be read
    (one log line each).  JAX warns on such an entry at every lookup, compiles the program and
    never replaces the entry (its writer skips an existing key), and writes entries in place:
    a crash mid-write leaves one.  Entries checked before are listed, with their size and
    mtime, in ``_VERIFIED`` so a start reads only the entries that are new or changed."""
    if decompress_executable is None:
        return
    manifest = os.path.join(cache_dir, _VERIFIED)
    try:
        with open(manifest) as f:
            known = json.load(f)
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError, UnicodeDecodeError):
        known = {}
    verified = {}
    for name in sorted(os.listdir(cache_dir)):
        if not name.endswith(_JAX_ENTRY_SUFFIX):
            continue
        path = os.path.join(cache_dir, name)
        try:
            st = os.stat(path)
        except OSError:   # removed meanwhile by another process
            continue
        stamp = [st.st_size, st.st_mtime_ns]
        if known.get(name) != stamp:
            problem = _jax_entry_problem(path)
            if problem is not None:
                cache_files.discard(path, problem, "removed; JAX compiles its program again")
                continue
        verified[name] = stamp
    if verified != known:
        try:
            cache_files.atomic_write(manifest, json.dumps(verified).encode())
        except OSError:
            pass   # a read-only cache: checked again next time


def enable_persistent_cache(cache_dir: str) -> None:
    """Points JAX's compilation cache at ``cache_dir`` (its unreadable entries removed first:
    :func:`check_persistent_cache`), caching even small programs."""
    os.makedirs(cache_dir, exist_ok=True)
    check_persistent_cache(cache_dir)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

"""Ahead-of-time compilation support: the persistent cache and the compile guard.

JAX reports tracing, XLA compilation and persistent-cache lookups through
``jax.monitoring``; one process-wide listener counts them, and the runner compares the
counts around every step after warm-up.
"""

from __future__ import annotations

import os
import threading
from collections import Counter

import jax

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_MISS_EVENT = "/jax/compilation_cache/cache_misses"

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


def enable_persistent_cache(cache_dir: str) -> None:
    """Points JAX's compilation cache at ``cache_dir``, caching even small programs."""
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

"""Where jaxllm keeps files between runs (compiled programs, converted tokenizers, native
kernels).  A leaf: the native CPU kernels (``cpu/native.py``) read it without importing the
engine's configuration."""

from __future__ import annotations

import os


def default_cache_dir() -> str:
    """Where compiled programs and converted tokenizers persist between runs."""
    root = os.environ.get("JAXLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxllm")
    return root

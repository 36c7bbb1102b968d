"""Handing freed host memory back to the OS after the start-up's big temporary allocations.

glibc keeps freed chunks below its (self-raising) mmap threshold in the heap, so the
dequantized float32 copy of the weights (~0.5 GB for the built-in model) and XLA's
compile-time buffers would still count in a served model's resident memory.
"""

from __future__ import annotations

import ctypes
import gc


def return_freed_memory() -> None:
    """``malloc_trim(0)`` after a collection; a no-op where there is no glibc."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass

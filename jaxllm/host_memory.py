"""Host memory the CPU backend's arrays live in: freed start-up memory handed back to the
OS, and the weights kept in 2 MiB pages.

glibc keeps freed chunks below its (self-raising) mmap threshold in the heap, so the
dequantized float32 copy of the weights (~0.5 GB for the built-in model) and XLA's
compile-time buffers would still count in a served model's resident memory.

A decode step reads every weight once, 92 MiB for the built-in model: in 4 KiB pages that is
23,000 pages a token, most of them a TLB miss, and in a VM each miss walks two page tables
(the guest's and the host's).  XLA's allocator places each weight's buffer among other
allocations of the heap, which the kernel backs with 4 KiB pages unless told otherwise
(transparent huge pages are usually ``madvise``-only), so :func:`in_huge_pages` copies the
host weights into one mapping advised ``MADV_HUGEPAGE`` before it is touched, and the CPU
backend's ``device_put`` aliases those arrays rather than copying them (batch-1 decode of the
built-in model 4-9% faster on an AVX-512 Xeon VM, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import gc
import mmap

import jax
import numpy as np

HUGE_PAGE = 2 << 20
ALIGN = 64   # each array's start: a cache line (the CPU backend aliases host arrays so aligned)


def return_freed_memory() -> None:
    """``malloc_trim(0)`` after a collection; a no-op where there is no glibc."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def huge_pages_possible() -> bool:
    """Whether this OS can back an advised mapping with transparent huge pages (Linux, THP not
    ``never``)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def in_huge_pages(tree):
    """``tree`` with its numpy arrays copied into one private anonymous mapping advised
    ``MADV_HUGEPAGE`` (each array 64-byte aligned, the mapping's start 2 MiB aligned), the
    other leaves as they are; ``tree`` itself where huge pages are not possible here.  The
    views keep the mapping alive."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, a in enumerate(leaves) if isinstance(a, np.ndarray) and a.nbytes]
    if not arrays or not huge_pages_possible():
        return tree
    offsets, size = {}, 0
    for i in arrays:
        offsets[i] = size
        size += -(-leaves[i].nbytes // ALIGN) * ALIGN
    size = -(-size // HUGE_PAGE) * HUGE_PAGE
    # One huge page more, so that a 2 MiB-aligned stretch of `size` bytes lies inside it.
    buf = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(buf, np.uint8)   # [size + 2 MiB], untouched: no page is faulted in yet
    start = -raw.ctypes.data % HUGE_PAGE
    buf.madvise(mmap.MADV_HUGEPAGE, start, size)   # before the first write faults pages in
    out = list(leaves)
    for i in arrays:
        a = np.ascontiguousarray(leaves[i])
        view = raw[start + offsets[i]:start + offsets[i] + a.nbytes].view(a.dtype).reshape(a.shape)
        view[...] = a
        out[i] = view
    return jax.tree.unflatten(treedef, out)

"""Pin glibc's mmap threshold so that big, short-lived tensors go back to the OS when freed.

Sampling allocates [batch, vocab] tensors of a different size every step (logits, their float copy, the
sort for top-p). glibc raises its mmap threshold each time it frees an mmapped chunk, after which such
tensors land in the heap, which fragments and is never trimmed: the engine process of a 40-minute
temperature-sampling run at pp=2 grew past 18 GiB and was OOM-killed (about 33 MB/s), while with the
threshold pinned at 1 MiB it stayed at 0.5 GiB. Setting the threshold once turns the adaptation off.
"""
from __future__ import annotations

import ctypes
import os
import sys

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
DEFAULT_THRESHOLD = 1 << 20


def pin_mmap_threshold(nbytes: int | None = None) -> bool:
    """mallopt(M_MMAP_THRESHOLD, nbytes); $TDPIPE_MMAP_THRESHOLD overrides (0 leaves glibc alone).
    Returns whether it was set (False off glibc)."""
    if nbytes is None:
        nbytes = int(os.environ.get("TDPIPE_MMAP_THRESHOLD", DEFAULT_THRESHOLD))
    if nbytes <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)))
    except (OSError, AttributeError):
        return False


def trim_heap() -> bool:
    """malloc_trim(0): give the heap's free pages back to the OS now. The CPU platform keeps freed memory
    in the heap between steps (platforms/cpu.keep_freed_memory), so a KV cache or weights dropped by
    sleep() would otherwise stay resident. Returns whether glibc released anything (False off glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(ctypes.c_size_t(0)))
    except (OSError, AttributeError):
        return False

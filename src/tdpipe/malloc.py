"""Host memory below torch: glibc's mmap threshold pinned so that big, short-lived tensors go back to the OS
when freed, the heap trimmed on request, and zeroed mappings for the KV cache (zeroed_mapping).

Sampling allocates [batch, vocab] tensors of a different size every step (logits, their float copy, the
sort for top-p). glibc raises its mmap threshold each time it frees an mmapped chunk, after which such
tensors land in the heap, which fragments and is never trimmed: the engine process of a 40-minute
temperature-sampling run at pp=2 grew past 18 GiB and was OOM-killed (about 33 MB/s), while with the
threshold pinned at 1 MiB it stayed at 0.5 GiB. Setting the threshold once turns the adaptation off.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
MADV_POPULATE_WRITE = 23  # madvise advice (Linux 5.14+): fault a range in, writable, without writing it
POPULATE_CHUNK = 16 << 20
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


def zeroed_mapping(nbytes: int) -> mmap.mmap:
    """`nbytes` of zeros as an anonymous mapping, returned at once: a thread faults the pages in behind the
    caller's back (the kernel zeroes them; madvise(MADV_POPULATE_WRITE) through ctypes, which lets go of the
    GIL), so start-up goes on while the memory is prepared instead of waiting for torch.zeros to write it
    (1 s for 4 GiB here), and the first steps that write the cache do not pay a page fault per 4 KiB either.
    Where the kernel lacks the advice, pages fault in on first write."""
    buf = mmap.mmap(-1, nbytes)
    if sys.platform.startswith("linux"):
        threading.Thread(target=_populate, args=(buf, nbytes), name="tdpipe-populate", daemon=True).start()
    return buf


def _populate(buf: mmap.mmap, nbytes: int) -> None:
    """Holds `buf` until the pages are in, so the mapping cannot be unmapped (and reused) under it. At the
    lowest priority (Linux nices threads one by one): start-up work on a busy core goes first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        for start in range(0, nbytes, POPULATE_CHUNK):  # in pieces: the address space's lock is let go between
            n = min(POPULATE_CHUNK, nbytes - start)
            if libc.madvise(ctypes.c_void_p(addr + start), ctypes.c_size_t(n), MADV_POPULATE_WRITE) != 0:
                return
    except (OSError, AttributeError, ValueError, TypeError):
        pass

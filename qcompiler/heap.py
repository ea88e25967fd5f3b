"""The glibc heap of a compile: small buffers are reused, large ones and freed pages go back to the OS.

glibc serves a request of at least its mmap threshold with a fresh ``mmap`` and unmaps it on
``free``; every page of such a buffer is faulted in and zero-filled by the kernel when first
touched. The compile's hot loops work a block of rows at a time (``quant/rtn.py``,
``ir/row_blocks.py``: a few MB of float32 each), so with the threshold fixed at glibc's largest,
32 MiB, those blocks are served from the heap and reused, while whole-tensor buffers (a 1 GB
embedding's bytes) are still unmapped on free and memory follows the largest tensor. The trim
threshold (64 MiB) bounds what a heap keeps of its freed top. Measured on the 1.1B checkpoint
(``docs/performance.md``, 2026-12-03): the 1 MiB threshold this replaced faulted in 54 GB of pages
(13.6M faults, 36 s of kernel time of a 54 s compile); with this policy and the row blocks, 0.6M.

Heap memory a thread frees in the middle of its heap stays resident (glibc trims only a heap's top),
and when what is freed there does not fit the next requests the heap grows past it: streaming the
8B shape to q4_k_m kept 660 MB of freed pages resident after 4 of 32 layers and was past 4.4 GB
before its last layers. ``release_free_pages`` (``malloc_trim(0)``: every arena, free pages in the
middle too) is called after each tensor of the per-tensor loops (``parallel.ordered_map``, the
stream's workers) and trims when more than ``SLACK`` (512 MiB) of the resident heap is free: a trim
is paid for in page faults when the pages are used again (trimming after every tensor cost the 1.1B
compressed-tensors compile 5 s of kernel time), so the slack bounds what is kept, not every page.
The block loops inside one tensor still reuse their buffers.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""mallopt parameter numbers (glibc's malloc.h)."""
MMAP_THRESHOLD = 32 << 20
"""glibc's largest mmap threshold (``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit)."""
TRIM_THRESHOLD = 64 << 20
SLACK = 512 << 20
"""Resident heap bytes beyond the allocated ones that ``release_free_pages`` lets stand."""


MALLINFO2 = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
"""``struct mallinfo2``'s fields (glibc 2.33 and later), every one a ``size_t``."""
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2]  # pyright: ignore[reportUnannotatedClassAttribute]


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


_LIBC = _glibc()


def _mallinfo2() -> Callable[[], _Mallinfo2] | None:
    info = getattr(_LIBC, "mallinfo2", None)  # glibc 2.33 and later
    if info is not None:
        info.restype = _Mallinfo2
    return info


_MALLINFO2 = _mallinfo2()


def resident_slack() -> int | None:
    """Resident anonymous bytes beyond what malloc has handed out (``mallinfo2``'s heap and mmapped
    bytes in use): an upper bound of the free heap pages still resident; ``None`` where unknown."""
    if _MALLINFO2 is None:
        return None
    used = _MALLINFO2()
    try:
        with open("/proc/self/statm") as fh:
            fields = fh.read().split()
        anon_pages = int(fields[1]) - int(fields[2])  # resident less file-backed: anonymous pages
    except (OSError, ValueError, IndexError):
        return None
    return anon_pages * PAGE - int(used.uordblks) - int(used.hblkhd)


def release_free_pages(slack: int = SLACK) -> bool:
    """Hand the pages of every free heap chunk back to the OS (``malloc_trim(0)``) when more than
    ``slack`` bytes of what is resident is not allocated (``resident_slack``; always where that is
    unknown); whether it trimmed (``False`` on any other C library)."""
    if _LIBC is None:
        return False
    spare = resident_slack()
    if spare is not None and spare <= slack:
        return False
    try:
        _LIBC.malloc_trim(0)
    except AttributeError:
        return False
    return True


def reuse_small_buffers() -> bool:
    """Set the policy above; ``False`` (and no change) on any other C library."""
    if _LIBC is None:
        return False
    try:
        fixed = _LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        return bool(fixed) and bool(_LIBC.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except AttributeError:
        return False

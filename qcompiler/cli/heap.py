"""Give freed tensor buffers back to the operating system (glibc only).

glibc's allocator serves a request of at least its mmap threshold with ``mmap`` and unmaps it on
``free``, but after each such free it raises the threshold (up to 32 MiB), so later buffers of a few
to 32 MiB come from its heaps, one per thread, and freed ones stay there. A streaming compile frees
thousands of such buffers in worker threads; on a 1.1B model that kept about 0.5 GB resident that
nothing used (peak RSS 1.99 GB against 1.46 GB with the threshold fixed; ``docs/performance.md``).
Fixing the threshold at 1 MiB (``mallopt(M_MMAP_THRESHOLD)``) returns every large buffer on free.
"""

from __future__ import annotations

import ctypes
import platform

M_MMAP_THRESHOLD = -3
"""mallopt parameter number (glibc's malloc.h)."""
THRESHOLD = 1 << 20


def return_large_buffers() -> bool:
    """Fix glibc's mmap threshold at 1 MiB; ``False`` (and no change) on any other C library."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD))
    except (OSError, AttributeError):
        return False

"""The compile's glibc heap handling (``qcompiler.heap``), in a fresh interpreter each: the policy is
process-wide. Freed heap memory pinned below a live allocation stays resident until
``release_free_pages`` hands its pages back."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

PINNED = """
import ctypes
from qcompiler.heap import release_free_pages, reuse_small_buffers

def anon_mb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1024

assert reuse_small_buffers()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
big, pins = [], []
for _ in range(200):  # 4 MiB buffers (heap-served under the 32 MiB threshold), each followed by a pin
    p = libc.malloc(4 << 20)
    ctypes.memset(p, 1, 4 << 20)
    big.append(p)
    pins.append(libc.malloc(200_000))  # from the top, after the buffer: no free chunk that large
for p in big:
    libc.free(p)
held = anon_mb()
assert release_free_pages(0)
print(held, anon_mb())
"""


def test_release_free_pages_returns_freed_heap_pages() -> None:
    out = subprocess.run([sys.executable, "-c", PINNED], capture_output=True, text=True, check=True)
    held, after = (float(v) for v in out.stdout.split())
    assert held > 700, f"the 800 MiB of freed buffers should still be resident, found {held:.0f} MiB"
    assert after < held - 700, f"release_free_pages left {after:.0f} of {held:.0f} MiB resident"

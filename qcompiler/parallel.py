"""Ordered, bounded parallel map over threads (numpy, torch and hashlib release the GIL on large
arrays, so per-tensor work runs on every core without copying tensors between processes).

``ordered_map(fn, items, jobs)`` yields ``fn(item)`` in the order of ``items`` whatever order the
workers finish in, with at most ``2 * jobs`` items submitted and not yet consumed (and, given their
``size``, at most ``budget`` bytes of them): what is resident follows the window, not the number of
items. ``jobs <= 1`` runs inline, in order, in this thread.
An exception from ``fn`` is raised by the iterator at that item's position (the remaining work is
cancelled), so a result that depends on each item alone is the same for any ``jobs``. After each
item the heap's free pages go back to the OS when much of it is free
(``qcompiler.heap.release_free_pages``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from qcompiler.heap import release_free_pages
from qcompiler.interrupt import check

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(
    fn: Callable[[T], R], items: Iterable[T], jobs: int, size: Callable[[T], int] | None = None, budget: int = 0
) -> Iterator[R]:
    """See the module docstring; with ``size``, the items submitted and not yet consumed also hold at
    most ``budget`` bytes between them (an item larger than that runs alone)."""

    def one(item: T) -> R:
        check()  # a recorded SIGINT/SIGTERM (qcompiler/interrupt.py)
        try:
            return fn(item)
        finally:
            release_free_pages()  # the item's freed temporaries, past the slack (qcompiler/heap.py)

    if jobs <= 1:
        for item in items:
            yield one(item)
        return
    pending: deque[tuple[Future[R], int]] = deque()
    held = 0
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        with kernel_threads(jobs):
            for item in items:
                n = size(item) if size is not None else 0
                while pending and (len(pending) >= 2 * jobs or (size is not None and held + n > budget)):
                    done, m = pending.popleft()
                    held -= m
                    yield done.result()
                pending.append((pool.submit(one, item), n))
                held += n
            while pending:
                yield pending.popleft()[0].result()
    finally:
        for f, _ in pending:
            f.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def kernel_threads(jobs: int) -> Generator[None]:
    """One thread per kernel call (torch's intra-op pool, numpy's BLAS) while ``jobs >= 2`` workers
    are the parallelism. Left alone, each worker's torch op or BLAS call fans out over every core
    too: ``2 * jobs`` spinning threads on ``jobs`` cores (a 1.1B compile, paired runs: 6% of its CPU
    time and 5% of its wall time). Restored on exit; a library not imported yet is left alone (it is
    not imported here)."""
    if jobs <= 1:
        yield
        return
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    blas = blas_limit()
    try:
        if torch is not None:
            torch.set_num_threads(1)
        yield
    finally:
        if torch is not None and before is not None:
            torch.set_num_threads(before)
        if blas is not None:
            blas.restore_original_limits()


def blas_limit() -> Any:
    """numpy's BLAS held to one thread (``threadpoolctl``), or ``None`` where numpy or threadpoolctl
    is not loaded."""
    if "numpy" not in sys.modules:
        return None
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(limits=1, user_api="blas")


class ByteWindow:
    """Admits items while at most ``count`` are in and their bytes stay within ``budget``; an item
    is always admitted when nothing is in (one item larger than the budget still runs, alone)."""

    def __init__(self, budget: int, count: int) -> None:
        self.budget, self.count = budget, max(count, 1)
        self.items = self.bytes = 0
        self.cv = threading.Condition()

    def fits(self, n: int) -> bool:
        return self.items == 0 or (self.items < self.count and self.bytes + n <= self.budget)

    def acquire(self, n: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.fits(n))
            self.items += 1
            self.bytes += n

    def release(self, n: int) -> None:
        with self.cv:
            self.items -= 1
            self.bytes -= n
            self.cv.notify_all()

"""``qcompiler.parallel``: the ordered map keeps input order for any worker count and, given item
sizes, its items in flight within a byte budget; the byte window admits by count and bytes, a
too-large item alone; while workers run, each kernel call is held to one thread (torch, numpy's BLAS)
and restored after."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch
from threadpoolctl import threadpool_info

from qcompiler.parallel import ByteWindow, kernel_threads, ordered_map


def test_ordered_map_keeps_the_input_order_for_any_jobs() -> None:
    def slow_square(i: int) -> int:
        time.sleep(0.001 * (7 - i % 7))
        return i * i

    for jobs in (1, 2, 4):
        assert list(ordered_map(slow_square, range(40), jobs)) == [i * i for i in range(40)]


def test_ordered_map_holds_its_items_in_flight_to_a_byte_budget() -> None:
    """Items submitted and not yet consumed hold at most ``budget`` bytes (sizes 30 and 40 pair up
    under 100, the 120 runs alone); the results keep the input order."""
    sizes = [30, 40, 30, 120, 40, 30, 30, 40]
    lock = threading.Lock()
    running: set[int] = set()
    seen: list[set[int]] = []

    def work(i: int) -> int:
        with lock:
            running.add(i)
            seen.append(set(running))
        time.sleep(0.01)
        with lock:
            running.discard(i)
        return i

    got = list(ordered_map(work, range(len(sizes)), 4, lambda i: sizes[i], 100))
    assert got == list(range(len(sizes)))
    assert all(s == {3} or (3 not in s and sum(sizes[i] for i in s) <= 100) for s in seen), seen
    assert any(len(s) > 1 for s in seen)  # the small ones did run side by side


def test_the_byte_window_admits_by_count_and_bytes() -> None:
    w = ByteWindow(budget=100, count=3)
    w.acquire(60)
    assert w.fits(40)
    assert not w.fits(41)
    w.acquire(40)
    assert not w.fits(1)  # full in bytes
    w.release(60)
    w.release(40)
    assert w.fits(500)  # nothing in: even an item over the budget runs, alone
    w.acquire(500)
    assert not w.fits(1)
    w.release(500)
    for _ in range(3):
        w.acquire(1)
    assert not w.fits(1)  # full in count


def test_a_waiting_item_enters_when_bytes_are_released() -> None:
    w = ByteWindow(budget=100, count=4)
    w.acquire(80)
    entered = threading.Event()

    def second() -> None:
        w.acquire(50)
        entered.set()

    t = threading.Thread(target=second)
    t.start()
    assert not entered.wait(0.05)
    w.release(80)
    assert entered.wait(5)
    t.join()
    assert (w.items, w.bytes) == (1, 50)


def test_kernel_threads_holds_torch_and_blas_to_one_thread_while_workers_run() -> None:
    np.dot(np.ones((2, 2)), np.ones((2, 2)))  # numpy's BLAS loaded
    before = torch.get_num_threads()
    blas_before = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    seen = list(ordered_map(lambda _: torch.get_num_threads(), range(4), jobs=2))
    assert seen == [1, 1, 1, 1]
    with kernel_threads(2):
        assert torch.get_num_threads() == 1
        assert all(i["num_threads"] == 1 for i in threadpool_info() if i["user_api"] == "blas")
    with kernel_threads(1):  # one job: the kernels keep every core
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before
    assert [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"] == blas_before

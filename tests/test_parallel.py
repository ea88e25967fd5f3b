"""``qcompiler.parallel``: the ordered map keeps input order for any worker count, and the byte
window admits by count and bytes, a too-large item alone."""

from __future__ import annotations

import threading
import time

from qcompiler.parallel import ByteWindow, ordered_map


def test_ordered_map_keeps_the_input_order_for_any_jobs() -> None:
    def slow_square(i: int) -> int:
        time.sleep(0.001 * (7 - i % 7))
        return i * i

    for jobs in (1, 2, 4):
        assert list(ordered_map(slow_square, range(40), jobs)) == [i * i for i in range(40)]


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

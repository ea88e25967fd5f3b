"""SIGINT/SIGTERM stop a run even when Python drops the KeyboardInterrupt (qcompiler/interrupt.py)."""

from __future__ import annotations

import os
import signal
import sys
import weakref

import pytest

from qcompiler.interrupt import Interrupted, check, deferred, stopped_by_signals


class Target:
    pass


def lose_a_signal(signum: int) -> None:
    """Send ``signum`` from inside a weakref callback: the handler's raise lands there and is dropped."""
    x = Target()
    ref = weakref.ref(x, lambda _: os.kill(os.getpid(), signum))
    del x
    assert ref() is None


def compile_like(signum: int, boundaries: list[str]) -> None:
    with stopped_by_signals():
        lose_a_signal(signum)
        boundaries.append("lost")  # the run went on past the signal
        check()
        boundaries.append("past the boundary")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_lost_in_a_weakref_callback_still_stops(signum: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python ignores the raise; the run goes on, but the next boundary (``check``) raises. The
    dropped raise is not reported as "Exception ignored" (with a traceback); other unraisables are."""
    reported: list[BaseException | None] = []

    def report(u: sys.UnraisableHookArgs) -> None:
        reported.append(u.exc_value)

    monkeypatch.setattr(sys, "unraisablehook", report)
    boundaries: list[str] = []
    with pytest.raises(Interrupted, match=f"signal {signum}"):
        compile_like(signum, boundaries)
    assert boundaries == ["lost"]
    assert reported == []
    check()  # the record ends with the block
    with stopped_by_signals():
        x = Target()
        ref = weakref.ref(x, lambda _: 1 / 0)
        del x
        assert ref() is None
    assert len(reported) == 1
    assert isinstance(reported[0], ZeroDivisionError)


def test_a_lost_signal_with_no_boundary_after_it_fails_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    def ignore(u: sys.UnraisableHookArgs) -> None:
        pass

    monkeypatch.setattr(sys, "unraisablehook", ignore)
    with pytest.raises(Interrupted), stopped_by_signals():
        lose_a_signal(signal.SIGTERM)


def test_the_handlers_are_put_back() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with stopped_by_signals():
        assert signal.getsignal(signal.SIGINT) is not before[signal.SIGINT]
        check()  # nothing received: a no-op
    assert {s: signal.getsignal(s) for s in before} == before


def make_and_register(done: list[str]) -> None:
    with stopped_by_signals(), deferred():
        os.kill(os.getpid(), signal.SIGINT)
        done.append("made")  # not interrupted in between: the cleanup gets registered
        done.append("registered")


def test_a_signal_inside_deferred_is_raised_at_its_end() -> None:
    done: list[str] = []
    with pytest.raises(Interrupted, match=f"signal {signal.SIGINT}"):
        make_and_register(done)
    assert done == ["made", "registered"]

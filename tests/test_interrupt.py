"""SIGINT/SIGTERM stop a run even when Python drops the KeyboardInterrupt (qcompiler/interrupt.py)."""

from __future__ import annotations

import importlib
import importlib.abc
import os
import signal
import sys
import threading
import time
import weakref
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


def run_the_handler(signum: int, frame: FrameType) -> None:
    """The installed handler of ``signum``, run as if the signal came while ``frame`` ran."""
    handler = signal.getsignal(signum)
    assert callable(handler)
    handler(signum, frame)


class SignalInTheImportSystem(importlib.abc.MetaPathFinder):
    """Runs the stop handler as if ``signum`` came while the import system's own code ran (the frame
    that asks a finder for a module is one of ``importlib._bootstrap``)."""

    def __init__(self, signum: int, name: str) -> None:
        self.signum, self.name = signum, name
        self.frames: list[str] = []

    def find_spec(self, fullname: str, path: object, target: object = None) -> None:
        if fullname == self.name:
            caller = sys._getframe(1)
            self.frames.append(caller.f_code.co_filename)
            run_the_handler(self.signum, caller)


def import_in_a_thread(name: str) -> bool:
    """Whether another thread can import ``name`` within 20 s (a module lock left held: it cannot)."""
    done = threading.Event()

    def run() -> None:
        importlib.import_module(name)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(20)


def import_then_check(name: str, steps: list[str]) -> None:
    with stopped_by_signals():
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(name)
        steps.append("the import ended")
        check()
        steps.append("past the boundary")


def test_a_signal_inside_the_import_system_is_raised_at_the_next_boundary(tmp_path: Path) -> None:
    """Raised inside ``importlib._bootstrap`` it could leave the import lock or a module lock held
    (another thread importing then waits forever); it is recorded, the import ends as it would, and
    the next boundary raises it."""
    finder = SignalInTheImportSystem(signal.SIGINT, "qc_not_a_module")
    sys.meta_path.insert(0, finder)
    steps: list[str] = []
    try:
        with pytest.raises(Interrupted, match=f"signal {signal.SIGINT}"):
            import_then_check("qc_not_a_module", steps)
    finally:
        sys.meta_path.remove(finder)
    assert finder.frames == ["<frozen importlib._bootstrap>"]
    assert steps == ["the import ended"]
    (tmp_path / "qc_after_the_signal.py").write_text("X = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert import_in_a_thread("qc_after_the_signal")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("qc_after_the_signal", None)


def test_a_signal_in_a_module_body_unwinds_the_import(tmp_path: Path) -> None:
    """The body of a module being imported is ordinary code: the signal is raised there, the module
    is not left half-made in ``sys.modules``, and other threads import as before."""
    (tmp_path / "qc_signalled_module.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\nX = 1\n")
    (tmp_path / "qc_plain_module.py").write_text("Y = 2\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(Interrupted, match=f"signal {signal.SIGTERM}"), stopped_by_signals():
            importlib.import_module("qc_signalled_module")
        assert "qc_signalled_module" not in sys.modules
        assert import_in_a_thread("qc_plain_module")
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("qc_signalled_module", "qc_plain_module"):
            sys.modules.pop(name, None)


class SignalInADispatch(TorchDispatchMode):
    """Runs the stop handler inside torch's dispatch, as a signal landing in the Python that torch's
    C++ calls back into (``__torch_dispatch__``) would."""

    def __init__(self, signum: int) -> None:
        super().__init__()
        self.signum = signum
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        run_the_handler(self.signum, sys._getframe())
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def relu_then_check(mode: SignalInADispatch, steps: list[str]) -> None:
    with stopped_by_signals():
        with mode:
            y = torch.nn.functional.relu(torch.tensor([-1.0, 2.0]))
        steps.append(f"the op ended: {y.tolist()}")
        check()
        steps.append("past the boundary")


def test_a_signal_inside_torch_is_raised_at_the_next_boundary() -> None:
    """Raised in Python that torch's C++ called, it could abort the process (``std::terminate``); it
    is recorded, the op ends as it would, and the next boundary raises it."""
    mode = SignalInADispatch(signal.SIGTERM)
    steps: list[str] = []
    with pytest.raises(Interrupted, match=f"signal {signal.SIGTERM}"):
        relu_then_check(mode, steps)
    assert mode.ops[-1] == "aten.relu.default"
    assert steps == ["the op ended: [0.0, 2.0]"]


def relu_then_wait(mode: SignalInADispatch, steps: list[str]) -> None:
    with stopped_by_signals():
        with mode:
            torch.nn.functional.relu(torch.tensor([-1.0, 2.0]))
        steps.append("the op ended")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # no boundary here: only the signal sent again can stop it
            time.sleep(0.005)
        steps.append("waited it out")


def test_a_held_back_signal_is_sent_again_until_it_lands_where_a_raise_is_safe() -> None:
    mode = SignalInADispatch(signal.SIGINT)
    steps: list[str] = []
    start = time.monotonic()
    with pytest.raises(Interrupted, match=f"signal {signal.SIGINT}"):
        relu_then_wait(mode, steps)
    assert steps == ["the op ended"]
    assert time.monotonic() - start < 25

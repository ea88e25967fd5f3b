"""Stopping a long run on SIGINT/SIGTERM, even when Python loses the KeyboardInterrupt.

The handler raises KeyboardInterrupt in the main thread, wherever it happens to be. Python drops an
exception raised inside a weakref callback, a ``__del__`` or a GC finaliser (it prints "Exception
ignored in ..." and carries on), so a signal that lands there would let the compile run to the end
and publish. The handler therefore also records the signal, and ``check()`` (called at every
boundary: each tensor read, each work item, each pass, just before the publish swap) raises again
while one is recorded. The threads that do the work see the record too, so a stop needs no thread
to be told. The dropped raise is not reported as "Exception ignored" (a traceback the user did not
cause): the unraisable hook passes over it and reports anything else as before.

A signal that lands while the main thread runs the import machinery itself (a frame of
``importlib._bootstrap``, not the body of the module being imported) is recorded and not raised:
that code takes the global import lock and the module locks without guarding against an exception
in between, and a KeyboardInterrupt there left a lock held that another thread importing at the
same time then waited on forever, while the main thread waited on that thread's module lock (seen
about once in 40 compiles interrupted while they import transformers). The next boundary raises it.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Generator
from types import FrameType

# No lock: a handler can run inside another (two signals in a row), and would deadlock on one; a
# list's append and clear are atomic under the GIL.
_received: list[int] = []  # the signals seen while ``stopped_by_signals`` is active
_deferring = [0]  # depth of ``deferred`` blocks (the handler runs in the main thread, as they do)
IMPORT_MACHINERY = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")
"""Where the import system's own code runs (its locks are not safe against an exception)."""


class Interrupted(KeyboardInterrupt):
    """A recorded SIGINT/SIGTERM, raised again at a boundary."""


def check() -> None:
    """Raise ``Interrupted`` if a stop signal arrived (a no-op outside ``stopped_by_signals``)."""
    if _received:
        raise Interrupted(f"signal {_received[0]}")


@contextlib.contextmanager
def deferred() -> Generator[None]:
    """A signal inside the block is recorded, not raised, until the block ends: for making a thing
    and registering its cleanup (a spill directory and the callback that removes it), which a
    KeyboardInterrupt between the two would leave behind."""
    _deferring[0] += 1
    try:
        yield
    finally:
        _deferring[0] -= 1
    if not _deferring[0]:
        check()


def importing(frame: FrameType | None) -> bool:
    """The main thread was in the import machinery's own code when the signal came (see the module
    docstring); the body of a module being imported is not (an exception there unwinds cleanly)."""
    return frame is not None and frame.f_code.co_filename in IMPORT_MACHINERY


@contextlib.contextmanager
def stopped_by_signals(then: signal.Handlers | None = None) -> Generator[None]:
    """SIGINT and SIGTERM unwind like Ctrl-C, and stay recorded so that ``check()`` raises again.
    On exit the previous handlers come back, or ``then`` (the process entry point passes
    ``SIG_IGN``: the command is over, and a signal during the interpreter's teardown would only
    print a traceback from a finaliser)."""

    def stop(signum: int, frame: FrameType | None) -> None:
        _received.append(signum)
        if not _deferring[0] and not importing(frame):
            raise Interrupted(f"signal {signum}")

    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers (a caller embedding main() in a thread)
        return
    hook = sys.unraisablehook

    def unraisable(u: sys.UnraisableHookArgs) -> None:
        if not isinstance(u.exc_value, Interrupted):  # ours is recorded: check() raises it again
            hook(u)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    sys.unraisablehook = unraisable
    try:
        yield
        check()  # the raise was lost and nothing after it checked: still not a success
    finally:
        sys.unraisablehook = hook
        for s, handler in previous.items():
            signal.signal(s, handler if then is None else then)
        _received.clear()

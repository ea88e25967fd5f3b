"""Stopping a long run on SIGINT/SIGTERM, even when Python loses the KeyboardInterrupt.

The handler raises KeyboardInterrupt in the main thread, wherever it happens to be (but for the two
places below). Python drops an
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

So is a signal that lands while any frame of the main thread's stack is torch's own code: torch calls
back into Python from C++ (dispatch rules of fake tensors, hooks), and a KeyboardInterrupt raised in
such a callback where the C++ side cannot pass an exception on aborted the whole process ("terminate
called after throwing an instance of 'pybind11::error_already_set'", seen while the model ran on
fake tensors to find the modules in use), leaving the lock and the spill directory behind.

A signal held back in either place is sent to the main thread again ``RETRY_S`` later, until it
lands where a raise is safe (or a boundary raises it first): Ctrl-C takes effect within a fraction
of a second, not at the end of the phase. Once the main thread has raised, no retry is sent (it
would land in the cleanup the raise runs).
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Generator
from types import FrameType

# No lock: a handler can run inside another (two signals in a row), and would deadlock on one; a
# list's append and clear are atomic under the GIL.
_received: list[int] = []  # the signals seen while ``stopped_by_signals`` is active
_deferring = [0]  # depth of ``deferred`` blocks (the handler runs in the main thread, as they do)
_raised = [False]  # the main thread raised the recorded signal: held-back signals are not sent again
_generation = [0]  # one per ``stopped_by_signals`` block: a retry from an earlier block sends nothing
RETRY_S = 0.05
"""Seconds before a signal held back where a raise is unsafe is sent to the main thread again."""
IMPORT_MACHINERY = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")
"""Where the import system's own code runs (its locks are not safe against an exception)."""
CALLING_BACK = ("torch",)
"""Packages whose C++ calls back into Python where an exception may abort the process."""


class Interrupted(KeyboardInterrupt):
    """A recorded SIGINT/SIGTERM, raised again at a boundary."""


def check() -> None:
    """Raise ``Interrupted`` if a stop signal arrived (a no-op outside ``stopped_by_signals``)."""
    if _received:
        if threading.current_thread() is threading.main_thread():
            _raised[0] = True
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


def unsafe_to_raise(frame: FrameType | None) -> bool:
    """The main thread, at ``frame`` when the signal came, is where a raise could break the process
    (see the module docstring): in the import machinery's own code (the body of a module being
    imported is not: an exception there unwinds cleanly), or anywhere below a function of
    ``CALLING_BACK`` (below one of its module bodies only, as while torch imports its modules, is not)."""
    if frame is None:
        return False
    if frame.f_code.co_filename in IMPORT_MACHINERY:
        return True
    roots = package_roots()
    f: FrameType | None = frame
    while f is not None:
        if f.f_code.co_filename.startswith(roots) and f.f_code.co_name != "<module>":
            return True  # a module body of torch's runs as any other (the import system called it)
        f = f.f_back
    return False


def package_roots() -> tuple[str, ...]:
    """The directories of the ``CALLING_BACK`` packages imported so far (a path separator ends each)."""
    roots: list[str] = []
    for name in CALLING_BACK:
        origin = getattr(sys.modules.get(name), "__file__", None)
        if isinstance(origin, str):
            roots.append(os.path.join(os.path.dirname(origin), ""))
    return tuple(roots)


def send_again(signum: int, main: int, generation: int) -> None:
    """``signum`` to thread ``main`` in ``RETRY_S``, unless the main thread has raised by then or the
    block has ended. A bare thread: ``threading.Thread`` takes locks the main thread may hold here."""

    def later() -> None:
        time.sleep(RETRY_S)
        if _generation[0] == generation and _received and not _raised[0]:
            with contextlib.suppress(OSError):
                signal.pthread_kill(main, signum)

    _thread.start_new_thread(later, ())


@contextlib.contextmanager
def stopped_by_signals(then: signal.Handlers | None = None) -> Generator[None]:
    """SIGINT and SIGTERM unwind like Ctrl-C, and stay recorded so that ``check()`` raises again.
    On exit the previous handlers come back, or ``then`` (the process entry point passes
    ``SIG_IGN``: the command is over, and a signal during the interpreter's teardown would only
    print a traceback from a finaliser)."""

    main, generation = threading.get_ident(), _generation[0] + 1

    def stop(signum: int, frame: FrameType | None) -> None:
        _received.append(signum)
        if _deferring[0]:
            return  # the block's end raises it
        if unsafe_to_raise(frame):
            send_again(signum, main, generation)
            return
        _raised[0] = True
        raise Interrupted(f"signal {signum}")

    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers (a caller embedding main() in a thread)
        return
    hook = sys.unraisablehook

    def unraisable(u: sys.UnraisableHookArgs) -> None:
        if not isinstance(u.exc_value, Interrupted):  # ours is recorded: check() raises it again
            hook(u)

    _generation[0] = generation
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    sys.unraisablehook = unraisable
    try:
        yield
        check()  # the raise was lost and nothing after it checked: still not a success
    finally:
        sys.unraisablehook = hook
        for s, handler in previous.items():
            signal.signal(s, handler if then is None else then)
        _generation[0] += 1
        _received.clear()
        _raised[0] = False

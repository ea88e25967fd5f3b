"""``torch.export`` of a streamed model in a forked child, beside the reading.

The export is pure-Python tracing. In a thread of the compile it holds the GIL that the stream's
quantizer calls take back a dozen times per block of weights, so on a 1.1B model the two shared
about one core (stream 4.9 s alone, 8.7 s beside the export). A child forked once
``prepare_hf_dir`` has built the model on fake tensors, with the stand-ins of its quantized modules
swapped in, has an interpreter of its own: it exports, lowers the program (``capture``) with a
placeholder reference for every tensor the stream will make, and writes the module's text to a
pipe. The parent parses it (the textual IR round-trips) and binds each placeholder to the reference
the stream made, after checking both have the same dtype and shape.

Anything else falls back to capturing in the parent, as before: not Linux (``fork`` there is
what this relies on), not the main thread, no spill directory (the child's own blobs would be lost
with it), a child that failed (its error is
raised again, with its source line, by the export in the parent), a module whose stand-ins did not
hold (``Streamed.stand_ins_held``), a placeholder the stream filled otherwise.

Every object alive at the fork is frozen for the collector (``gc.freeze``) until the child is reaped:
a collection walking them writes to each one's header, and each page so written is copied, in the
child (which also collects rarely: it traces, writes and exits) or in the parent, for nothing.

The child touches nothing of the parent's: its standard streams go to ``/dev/null``, it ends with
``os._exit`` (no ``finally`` or ``atexit`` of the parent's stack runs there), it dies with the
parent (``PR_SET_PDEATHSIG``), and the parent kills and reaps it on any exit of ``ForkedCapture``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Generator, Mapping
from typing import Any

import torch

from qcompiler.frontend.context import TORCH_DTYPES
from qcompiler.frontend.hf import PREFIX
from qcompiler.interrupt import check, deferred
from qcompiler.ir.blobs import spill_active
from qcompiler.ir.core import BlobRef, Module, TensorDecl
from qcompiler.ir.dtypes import DTYPES

PLACEHOLDER = "placeholder"
"""The location of a placeholder reference (never read: the parent replaces every one)."""


def placeholders(shards: Mapping[str, list[Any]], stand_ins: Mapping[str, torch.nn.Module]) -> dict[str, BlobRef]:
    """Tensor-table name -> a placeholder for the reference the stream will make: a dense source
    tensor as it is stored, a quantized module's buffers as its stand-in holds them (the stream names
    them ``<weight>.<buffer>``, ``stream.quantize_job``). The sha256 is that of the name."""
    from qcompiler.frontend.reading import ST_IR

    out: dict[str, BlobRef] = {}
    quantized = {fqn.removeprefix(PREFIX) + ".weight": mod for fqn, mod in stand_ins.items()}
    for tensors in shards.values():
        for t in tensors:
            if t.name not in quantized:
                out[t.name] = placeholder(t.name, DTYPES[ST_IR[t.dtype]].name, tuple(t.shape))
    for weight, mod in quantized.items():
        for sub in mod.modules():
            for bname, b in sub._buffers.items():
                if b is not None:
                    key = f"{weight}.{bname}"
                    out[key] = placeholder(key, TORCH_DTYPES[b.dtype], tuple(int(d) for d in b.shape))
    return out


def placeholder(key: str, dtype: str, shape: tuple[int, ...]) -> BlobRef:
    digest = hashlib.sha256(f"{PLACEHOLDER}:{key}".encode()).hexdigest()
    return BlobRef(DTYPES[dtype], shape, digest, PLACEHOLDER)


def bind(m: Module, holes: Mapping[str, BlobRef], refs: Mapping[str, BlobRef]) -> Module | None:
    """``m`` with every placeholder replaced by the stream's reference of the same name, or ``None``
    when one is missing or differs in dtype or shape (the caller then captures in process)."""
    by_digest = {ref.sha256: key for key, ref in holes.items()}
    for name, decl in list(m.tensors.items()):
        if decl.blob.location != PLACEHOLDER:
            continue
        key = by_digest.get(decl.blob.sha256)
        real = refs.get(key) if key is not None else None
        if real is None or real.dtype != decl.blob.dtype or tuple(real.shape) != tuple(decl.blob.shape):
            return None
        m.tensors[name] = TensorDecl(name, real, decl.attrs, decl.comments, decl.loc)
    return m


class ForkedCapture:
    """One child exporting and lowering (see the module docstring); ``text()`` waits for it."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid, self.fd = pid, fd
        self.data = bytearray()
        self.reader = threading.Thread(target=self.read, name="qc-export-pipe", daemon=True)
        self.reader.start()
        self.status: int | None = None

    def read(self) -> None:
        with os.fdopen(self.fd, "rb") as f:
            while chunk := f.read(1 << 20):
                self.data += chunk

    def text(self) -> str | None:
        """The module's text, or ``None`` when the child failed (then nothing of it is used). A signal
        recorded and not raised (``qcompiler/interrupt.py``) is raised within a tenth of a second."""
        while self.reader.is_alive():
            check()
            self.reader.join(0.1)
        self.reap(kill=False)
        if self.status != 0 or not self.data.startswith(b"O"):
            return None
        return self.data[1:].decode("utf-8")

    def reap(self, kill: bool) -> None:
        if self.status is not None:
            return
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        _, status = os.waitpid(self.pid, 0)
        self.status = os.waitstatus_to_exitcode(status)


def available() -> bool:
    """Whether ``forked_capture`` can fork a child here: Linux, the main thread (the child resets
    signal handlers), a spill directory (the child's own blobs would be lost with it)."""
    main = threading.current_thread() is threading.main_thread()
    return sys.platform.startswith("linux") and main and spill_active()


@contextlib.contextmanager
def forked_capture(
    model: torch.nn.Module, inputs: Any, capture_args: dict[str, Any]
) -> Generator[ForkedCapture | None]:
    """A child running ``capture(model, inputs, **capture_args)`` (see the module docstring), or
    ``None`` where the platform or the blob store rules it out; the child is killed and reaped on
    leaving the block."""
    if not available():
        yield None
        return
    check()  # a signal recorded while the model was built: no child for it
    child: ForkedCapture | None = None
    try:
        with deferred():  # a signal from the fork to the registration is raised once the child is known
            r, w = os.pipe()
            gc.freeze()  # collections in either process leave the shared pages alone until the child is reaped
            pid = os.fork()
            if pid == 0:  # the child: never returns
                os.close(r)
                run_child(w, model, inputs, capture_args)
            os.close(w)
            child = ForkedCapture(pid, r)
        yield child
    finally:
        if child is not None:
            child.reap(kill=True)
        gc.unfreeze()


def run_child(fd: int, model: torch.nn.Module, inputs: Any, capture_args: dict[str, Any]) -> None:
    code = 1
    try:
        quiet_child()
        from qcompiler.frontend.capture import capture
        from qcompiler.ir.printer import print_module

        m = capture(model, inputs, **capture_args)
        payload = b"O" + print_module(m, keep_comments=True).encode("utf-8")
        code = 0
    except BaseException as e:
        payload = b"E" + f"{type(e).__name__}: {e}".encode("utf-8", "replace")
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os._exit(code)


def quiet_child() -> None:
    """Default signal actions, death with the parent, standard streams to /dev/null (a lock another
    parent thread held at the fork stays held here), no warnings or logging, one torch thread (the
    parent's OpenMP pool does not exist in the child)."""
    gc.set_threshold(100_000, 50, 1000)  # tracing allocates millions of objects; the child then exits
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives until os._exit
    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)
    torch.set_num_threads(1)

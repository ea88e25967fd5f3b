"""Reading an HF directory's shards for the streaming frontend (``stream.py``): every shard front to
back, once, its sha256 computed from the same bytes as they go by, each tensor handed to a pool of
workers in a bounded window (``stream_tensors``); and the tensor table of the shards' headers
(``source_tensors``), which the directory's gates checked before anything is read."""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from qcompiler.errors import QcError
from qcompiler.frontend.checkpoint import checkpoint_reader
from qcompiler.frontend.context import TORCH_DTYPES
from qcompiler.heap import release_free_pages
from qcompiler.interrupt import check
from qcompiler.parallel import ByteWindow, kernel_threads

ST_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
ST_IR = {name: TORCH_DTYPES[t] for name, t in ST_TORCH.items()}
"""safetensors dtype -> QIR dtype name."""
Buffer = bytearray | memoryview
"""A source tensor's bytes: read whole (``bytearray``) or into an uninitialised ``uint8`` array."""
CHUNK = 64 * 2**20
"""Bytes read (and hashed) per read call."""
WINDOW_BYTES = 256 * 2**20
"""Source bytes in flight per streaming job (beyond the largest tensor, which may always be alone)."""


class Stopped(Exception):
    """The reading was stopped from another thread (the capture beside it failed or was interrupted)."""


@dataclass(frozen=True)
class SourceTensor:
    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_tensor(root: Path, t: SourceTensor) -> torch.Tensor:
    with (root / t.file).open("rb") as fh:
        fh.seek(t.offset)
        data = bytearray(fh.read(t.nbytes))
    return as_tensor(data, t)


def as_tensor(data: Buffer, t: SourceTensor) -> torch.Tensor:
    if len(data) == 0:
        return torch.empty(t.shape, dtype=ST_TORCH[t.dtype])
    return torch.frombuffer(data, dtype=ST_TORCH[t.dtype]).reshape(t.shape)


def source_tensors(root: Path) -> dict[str, list[SourceTensor]]:
    """Shard file -> its tensors in file order (the headers were gated by ``checkpoint_inventory``)."""
    return checkpoint_reader().shard_tensors(root)


class Unhashed:
    """Stands in for the sha256 of a file ``EarlyDigests`` hashed: takes the bytes, hashes nothing."""

    def update(self, data: object) -> None:
        return None

    def hexdigest(self) -> str:
        return ""


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """The same file, unchanged: device, inode, size, modification and change times (the change time
    moves on any write and cannot be set back)."""
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns, a.st_ctime_ns) == (
        b.st_dev,
        b.st_ino,
        b.st_size,
        b.st_mtime_ns,
        b.st_ctime_ns,
    )


class EarlyDigests:
    """The sha256 of every shard of ``root``, computed in a thread of its own from the start of the
    compile, while the main thread imports transformers and builds the model (about 3 s on one core
    for a 1.1B model, the other idle). The stream then reads each file without hashing it, provided
    the file is the same one, unchanged (``same_file``), when the stream opens it and when it is done
    with it; a change in between is a ``SourceError``. Files are opened under the source path policy
    (a link out of the directory, a FIFO, a device are not read), each read to its size only; any
    refusal ends the thread, and those files are hashed by the stream as they are read. Once the
    stream asks for a file not hashed yet, the thread stops (it would compete with the stream)."""

    def __init__(self, root: Path) -> None:
        # imported here, in the calling thread: the hashing thread imports nothing (an import beside
        # one a signal interrupts in the main thread could wait on the lock it left, interrupt.py)
        from qcompiler.paths import SOURCE, open_in

        shard_names = checkpoint_reader().shard_names

        self.root = root
        self.open = partial(open_in, root, policy=SOURCE, field="shard")
        self.done: dict[str, tuple[str, os.stat_result]] = {}
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        try:
            names = shard_names(root)
        except (QcError, OSError):
            names = []  # the stream names the problem, reading the same index
        self.thread = threading.Thread(target=self.run, args=(names,), name="qc-early-sha256", daemon=True)
        self.thread.start()

    def run(self, names: list[str]) -> None:
        buf = bytearray(CHUNK)
        try:
            for name in names:
                raw, st = self.open(name)
                with cast(io.BufferedReader, raw) as fh:
                    h, left = hashlib.sha256(), st.st_size
                    while left and not self.stopped.is_set():
                        n = fh.readinto(memoryview(buf)[: min(CHUNK, left)])
                        if not n:
                            return
                        h.update(memoryview(buf)[:n])
                        left -= n
                    if left:
                        return
                with self.lock:
                    self.done[name] = (h.hexdigest(), st)
        except (QcError, OSError):
            return

    def take(self, name: str, now: os.stat_result) -> tuple[str, os.stat_result] | None:
        """``name``'s digest and the identity it was hashed with, if it was hashed already from the
        file the stream has open; else ``None``, and the thread stops."""
        with self.lock:
            known = self.done.get(name)
        if known is None or not same_file(known[1], now):
            self.stopped.set()
            return None
        return known

    def stop(self) -> None:
        self.stopped.set()


def stream_tensors(
    root: Path,
    shards: dict[str, list[SourceTensor]],
    job: Callable[[SourceTensor, Buffer], dict[str, Any]],
    jobs: int,
    advance: Callable[[int], None],
    stop: threading.Event | None = None,
    early: EarlyDigests | None = None,
    unchanged: dict[str, os.stat_result] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Read every shard front to back (file sha256 as it goes) and run ``job`` on each tensor in a pool
    of ``jobs`` workers, at most ``2 * jobs`` tensors resident and, beyond the first, no more bytes than
    the largest tensor or ``WINDOW_BYTES`` per job (a 1 GB embedding is quantized alone, not beside the
    head); results in file order. ``stop`` (set by another thread) ends the reading at the next tensor
    with ``Stopped``. A file ``early`` hashed already, unchanged since, is read without hashing.
    ``unchanged`` gets each file's ``os.stat_result`` where it was the same file (``same_file``) when
    its reading ended as when it began."""
    largest = max((t.nbytes for ts in shards.values() for t in ts), default=0)
    window = ByteWindow(max(largest, WINDOW_BYTES * jobs), 2 * max(jobs, 1))
    results: list[Future[dict[str, Any]]] = []
    digests: dict[str, str] = {}

    def run(t: SourceTensor, data: Buffer) -> dict[str, Any]:
        try:
            return job(t, data)
        finally:
            release_free_pages()  # what the tensor's work freed, past the slack (qcompiler/heap.py)
            advance(t.nbytes)
            window.release(t.nbytes)

    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool, kernel_threads(jobs):
        for file, tensors in shards.items():
            with (root / file).open("rb") as fh:
                began = os.fstat(fh.fileno())
                known = early.take(file, began) if early is not None else None
                h = Unhashed() if known is not None else hashlib.sha256()
                pos = 0
                for t in tensors:
                    check()  # a recorded SIGINT/SIGTERM (qcompiler/interrupt.py)
                    if stop is not None and stop.is_set():
                        raise Stopped(f"stopped before {t.name}")
                    if t.offset > pos:
                        h.update(fh.read(t.offset - pos))
                    window.acquire(t.nbytes)
                    data = np.empty(t.nbytes, dtype=np.uint8).data  # not zero-filled: every byte is read into it
                    view = memoryview(data)
                    got = 0
                    while got < t.nbytes:
                        n = fh.readinto(view[got : got + CHUNK])
                        if not n:
                            from qcompiler.frontend.weights_gate import SourceError

                            raise SourceError(
                                "file truncated while it was read", file=str(root / file), tensor=t.name,
                                expected=f"{t.nbytes} bytes", found=f"{got} bytes",
                            )  # fmt: skip
                        got += n
                    h.update(data)
                    pos = t.offset + t.nbytes
                    results.append(pool.submit(run, t, data))
                    del data, view
                h.update(fh.read())
                ended = os.fstat(fh.fileno())
                if unchanged is not None and same_file(began, ended):
                    unchanged[file] = ended
                if known is not None and not same_file(known[1], ended):
                    from qcompiler.frontend.weights_gate import SourceError

                    raise SourceError("the file changed while the compile read it", file=str(root / file))
            digests[file] = known[0] if known is not None else h.hexdigest()
        return [f.result() for f in results], digests

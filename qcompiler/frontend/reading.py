"""Reading an HF directory's shards for the streaming frontend (``stream.py``): every shard front to
back, once, its sha256 computed from the same bytes as they go by, each tensor handed to a pool of
workers in a bounded window (``stream_tensors``); and the tensor table of the shards' headers
(``source_tensors``), which the directory's gates checked before anything is read."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qcompiler.frontend.context import TORCH_DTYPES
from qcompiler.heap import release_free_pages
from qcompiler.interrupt import check
from qcompiler.parallel import ByteWindow

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
    from qcompiler.backends.safetensors.container import open_file
    from qcompiler.backends.safetensors.source import resolved, shard_names

    out: dict[str, list[SourceTensor]] = {}
    for file in shard_names(root):
        f = open_file(resolved(root, file))
        entries = sorted(f.tensors.values(), key=lambda e: e.begin)
        out[file] = [SourceTensor(file, e.name, e.dtype, e.shape, f.data_start + e.begin, e.nbytes) for e in entries]
    return out


def stream_tensors(
    root: Path,
    shards: dict[str, list[SourceTensor]],
    job: Callable[[SourceTensor, Buffer], dict[str, Any]],
    jobs: int,
    advance: Callable[[int], None],
    stop: threading.Event | None = None,
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Read every shard front to back (file sha256 as it goes) and run ``job`` on each tensor in a pool
    of ``jobs`` workers, at most ``2 * jobs`` tensors resident and, beyond the first, no more bytes than
    the largest tensor or ``WINDOW_BYTES`` per job (a 1 GB embedding is quantized alone, not beside the
    head); results in file order. ``stop`` (set by another thread) ends the reading at the next tensor
    with ``Stopped``."""
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

    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        for file, tensors in shards.items():
            h = hashlib.sha256()
            with (root / file).open("rb") as fh:
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
            digests[file] = h.hexdigest()
        return [f.result() for f in results], digests

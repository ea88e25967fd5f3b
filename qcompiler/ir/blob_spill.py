"""The blob store's spill: where ``keep_bytes`` puts blobs while a compile holds ``spilled(DIR)``
(``qcompiler.ir.blobs``), one file ``DIR/<sha256>`` per blob, and where a spilled blob goes once an
artifact file holds its bytes (``moved``).

A compile writes each weight's packed codes here as the stream makes them, then copies them into
the artifact's shard. ``moved`` ends the copy: the blob is read from the artifact file from then on
(through a descriptor opened once, so a later rename of the file changes nothing), and its spill
file is removed at once. The kernel then hands the spill file's pages to the next bytes the writer
writes; writing into pages it has not handed out for a while costs several times more (a 1.1B
model's 0.5 GB of codes: docs/performance.md, "moved blobs").

A moved blob read back is not hashed again (``written_here``), like a spill file: its bytes were
hashed as the store kept them, and checked as they were read to be written. Before anything is
published, the reopen through the production reader checks every tensor of the artifact file they
sit in against its sha256 (``ir/data_checks.py``): bytes changed there are an error, not a result.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from qcompiler.errors import BlobError

SPILLS: list[Path] = []
"""The active spill directories (``blobs.spilled``), innermost last: where ``keep`` writes."""
WRITTEN: dict[str, tuple[int, int]] = {}
"""sha256 -> (size, mtime_ns) of each spill file ``keep`` wrote after its bytes were hashed."""


@dataclass(frozen=True)
class Moved:
    """Where a moved blob's bytes are: ``offset`` in the file open as ``fd``; ``spill``: the spill
    directory it left (its entries go when that directory's ``spilled`` block ends)."""

    fd: int
    offset: int
    spill: Path


MOVED: dict[str, Moved] = {}
"""sha256 -> where each moved blob is now."""
OPEN: dict[tuple[Path, str], int] = {}
"""(spill directory, artifact file) -> the read-only descriptor ``moved`` opened on that file."""
LOCK = threading.Lock()


def keep(digest: str, data: bytes | memoryview) -> None:
    """Write ``data`` (whose sha256 is ``digest``) as the innermost spill's file ``digest``."""
    path = SPILLS[-1] / digest
    if path.exists():
        return
    tmp = path.with_name(f"{digest}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with tmp.open("wb") as fh:
            fh.write(data)
        tmp.replace(path)
    except OSError as e:  # ENOSPC, EDQUOT, EIO: a typed error naming the directory
        tmp.unlink(missing_ok=True)
        raise BlobError(
            f"spill directory {path.parent}: cannot write {memoryview(data).nbytes} bytes "
            f"({e.strerror or e}); free space on its file system or write the output elsewhere"
        ) from None
    st = path.stat()
    WRITTEN[digest] = (st.st_size, st.st_mtime_ns)


def spilled_bytes(sha: str, nbytes: int) -> bytes | None:
    """Blob ``sha`` from a spill file, else from where it moved (``None``: neither)."""
    for d in reversed(SPILLS):
        try:
            return (d / sha).read_bytes()
        except FileNotFoundError:
            continue
    at = MOVED.get(sha)  # looked up after the spill file: ``moved`` records the move before it unlinks
    return None if at is None else read_at(at, nbytes)


def read_at(at: Moved, nbytes: int) -> bytes:
    parts: list[bytes] = []
    got = 0
    while got < nbytes:
        piece = os.pread(at.fd, nbytes - got, at.offset + got)
        if not piece:
            break  # short: ``read_blob`` reports the wrong length
        parts.append(piece)
        got += len(piece)
    return b"".join(parts)


def in_spill(sha: str) -> bool:
    return sha in MOVED or any((d / sha).exists() for d in SPILLS)


def written_here(sha: str) -> bool:
    """Whether spill file ``sha`` is the one ``keep`` wrote (same size and mtime), or the blob moved."""
    if sha in MOVED:
        return True
    written = WRITTEN.get(sha)
    if written is None:
        return False
    for d in reversed(SPILLS):
        try:
            st = (d / sha).stat()
        except FileNotFoundError:
            continue
        return (st.st_size, st.st_mtime_ns) == written
    return False


def moved(sha: str, file: Path, offset: int) -> bool:
    """Blob ``sha``'s bytes are now at ``offset`` of ``file`` (an artifact file being written, its
    bytes up to there flushed): read it from there, and remove its spill file. ``False`` (nothing
    done) for a blob that is not a file of the innermost spill."""
    if not SPILLS:
        return False
    spill = SPILLS[-1]
    path = spill / sha
    if sha in MOVED or not path.exists():
        return False
    with LOCK:
        fd = OPEN.get((spill, str(file)))
        if fd is None:
            fd = OPEN[(spill, str(file))] = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
        MOVED[sha] = Moved(fd, offset, spill)
    WRITTEN.pop(sha, None)
    path.unlink(missing_ok=True)
    return True


def leave(directory: Path) -> None:
    """The end of ``directory``'s ``spilled`` block: its moved blobs forgotten, their files closed."""
    SPILLS.remove(directory)
    with LOCK:
        for sha in [k for k, v in MOVED.items() if v.spill == directory]:
            del MOVED[sha]
        for key in [k for k in OPEN if k[0] == directory]:
            os.close(OPEN.pop(key))

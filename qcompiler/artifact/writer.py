"""Transactional artifact writes: nothing is published unless everything was written, an existing
artifact at the destination is never damaged, and nothing else the user keeps at the output path
is deleted unless they said ``force`` (``--force``; the rules are in ``qcompiler.artifact.output``).

    with ArtifactWriter(dest) as w:
        w.write_file("model.safetensors", chunks)      # temp dir, fsync, size + sha256 recorded
        w.publish({"schema": 1, ...})                  # manifest.json last, fsync, atomic swap

Steps, in order: entry takes the output's lock (``OutputBusyError`` at once if another compile holds
it), refuses an output that is not ours to replace (``OutputError``) and removes stale leftovers of
interrupted publishes; files are written into ``.<name>.tmp-<pid>-<id>`` next to the destination
(same filesystem), each hashed while streamed and fsync'd (in a thread, beside what is written next;
all of them done before the manifest); ``manifest.json`` is written last, listing
every file with size and sha256 (the root of reachability), then fsync'd with its directory; a
``verify`` callback reopens the finished temp directory through the production reader; the temp
directory replaces the destination by an atomic exchange (``renameat2(RENAME_EXCHANGE)`` where the
kernel has it; otherwise two renames that keep the previous content whole under
``.<name>.old-<pid>-<id>`` until the new one is in place). What was displaced is checked again, as
it is what would be deleted: if it is not ours to replace (it changed while we wrote) it is swapped
back. The parent directory is fsync'd, the displaced content removed, the lock released. Any
exception before the exchange removes the temp directory and leaves the destination as it was; an
``OSError`` becomes an ``ArtifactWriteError`` naming the path and the system's reason. ``fail_at``
injects a failure at a named step; ``QC_WRITER_PAUSE_AT=STEP`` in the environment makes the writer
print ``paused at step STEP`` to stderr and sleep there (600 s), so a test can SIGKILL it there.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from qcompiler.artifact.output import (
    LIVE,
    ArtifactWriteError,
    OutputBusyError,
    OutputError,
    OutputLock,
    check_parent,
    describe,
    leftover_path,
    leftovers,
    os_error,
    output_path,
    refusal,
    remove_path,
)
from qcompiler.env import QC_WRITER_PAUSE_AT
from qcompiler.interrupt import check

__all__ = ["ArtifactWriteError", "ArtifactWriter", "InjectedFailure", "OutputBusyError", "OutputError"]

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
"""A detached signature over ``manifest.json``'s bytes (``qcompiler sign``); the only file besides the
manifest that the manifest does not list."""
SELF_DIGEST = "self_sha256"
"""Manifest key holding the sha256 of the manifest's own canonical JSON (every other key), so a
changed byte in the manifest itself is caught too."""
STEPS = ("open", "write", "fsync-file", "manifest", "fsync-dir", "verify", "swap", "cleanup")
"""Named points where ``fail_at`` can inject a failure (and ``QC_WRITER_PAUSE_AT`` pause)."""
PAUSE_ENV = QC_WRITER_PAUSE_AT.name


class InjectedFailure(ArtifactWriteError):
    """A failure injected by a test at a named step."""


@dataclass(frozen=True)
class FileRecord:
    path: str
    size: int
    sha256: str


def manifest_digest(body: dict[str, Any]) -> str:
    """sha256 of the canonical JSON (sorted keys, compact) of ``body`` without ``self_sha256``."""
    rest = {k: v for k, v in body.items() if k != SELF_DIGEST}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with ``renameat2(RENAME_EXCHANGE)``; False if the kernel or libc lacks it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a))


Written = Callable[[int, int, Path], None]
"""``(offset, length, path)``: a chunk an artifact file now holds (``ArtifactWriter.write_file``)."""


class FileSink:
    """One artifact file being written (``ArtifactWriter.stream``): size and sha256 kept as it goes."""

    def __init__(self, f: BinaryIO, step: Callable[[str], None], path: Path) -> None:
        self.f, self.step, self.path, self.size, self.digest = f, step, path, 0, hashlib.sha256()

    def write(self, chunk: bytes | memoryview) -> None:
        self.step("write")
        self.f.write(chunk)
        self.digest.update(chunk)
        self.size += len(chunk)


class Syncs:
    """The artifact files' fsyncs, run in a thread of their own while the next file is written and the
    artifact reopened (a 1.1B model's 0.7 GB shard: 0.4 s of waiting for the disk); ``wait`` joins
    them all, before the manifest is written."""

    def __init__(self) -> None:
        self.pool: ThreadPoolExecutor | None = None
        self.pending: list[tuple[str, Path, Future[None]]] = []

    def start(self, rel: str, path: Path, fd: int) -> None:
        """fsync and close ``fd`` (a duplicate of ``rel``'s descriptor, so the file may be closed)."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qc-fsync")
        self.pending.append((rel, path, self.pool.submit(sync_and_close, fd)))

    def wait(self) -> list[tuple[str, Path, OSError]]:
        """Every fsync done; the failed ones, in the order their files were written."""
        failed = [(rel, path, e) for rel, path, f in self.pending if isinstance(e := f.exception(), OSError)]
        self.pending = []
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        return failed


def sync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class ArtifactWriter:
    """Writes one artifact directory transactionally (see the module docstring)."""

    dest: Path
    fail_at: str | None = None
    force: bool = False
    """Replace an output that is not ours (a file, a symlink, a non-artifact directory); a writer
    inside ``claim_output(dest, force=True)`` of the same thread inherits it."""
    files: list[FileRecord] = field(default_factory=list[FileRecord])
    published: bool = False

    def __post_init__(self) -> None:
        self.dest = output_path(self.dest)
        self.tmp = self.leftover_name("tmp")
        self.old: Path | None = None
        self.lock = OutputLock(self.dest, self.force)
        self.syncs = Syncs()

    def leftover_name(self, kind: str) -> Path:
        return leftover_path(self.dest, kind)

    def __enter__(self) -> ArtifactWriter:
        check_parent(self.dest, access=False)  # the system's own answer is the authority here
        try:
            self.dest.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise os_error(e, f"creating the directory of {self.dest}") from e
        self.lock.__enter__()
        try:
            ok, found = describe(self.dest)
            if not ok and not self.lock.forced:
                raise refusal(self.dest, found)
            for path in leftovers(self.dest):
                remove_path(path)
            self.step("open")
            self.tmp.mkdir()
        except BaseException as e:
            self.__exit__(type(e), e, None)
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.syncs.wait()  # every descriptor closed before the temp directory goes
        try:
            for path in ([] if self.published else [self.tmp]) + ([self.old] if self.old else []):
                with contextlib.suppress(ArtifactWriteError):  # the failure that brought us here is reported
                    remove_path(path)
        finally:
            LIVE.difference_update({str(p.absolute()) for p in (self.tmp, self.old) if p is not None})
            self.lock.__exit__(kind, exc, tb)
        if isinstance(exc, OSError):
            raise os_error(exc, f"writing the artifact {self.dest}") from exc

    def step(self, name: str) -> None:
        if QC_WRITER_PAUSE_AT.get() == name:
            print(f"paused at step {name}: {self.tmp}", file=sys.stderr, flush=True)
            time.sleep(600)
        if self.fail_at == name:
            raise InjectedFailure(f"injected failure at step '{name}' while writing {self.dest}")

    def write_file(
        self, rel: str, data: bytes | Iterable[bytes | memoryview], written: Written | None = None
    ) -> FileRecord:
        """Stream ``data`` into ``rel`` inside the artifact; returns its size and sha256. ``written``
        is called after each chunk with the chunk's offset, its length and the file's path, once the
        file holds it (flushed: a reader of the path sees it)."""
        with self.stream(rel) as f:
            for chunk in [data] if isinstance(data, bytes) else data:
                at = f.size
                f.write(chunk)
                del chunk  # dropped before the next one is made: one tensor's bytes at a time
                if written is not None:
                    f.f.flush()
                    written(at, f.size - at, f.path)
        return self.files[-1]

    @contextlib.contextmanager
    def stream(self, rel: str) -> Generator[FileSink]:
        """``rel`` inside the artifact, open for ``write(chunk)`` calls made while the caller produces
        the bytes (hashed as written); fsync'd and recorded (``files[-1]``) when the block ends."""
        if Path(rel).is_absolute() or ".." in Path(rel).parts or rel == MANIFEST:
            raise ArtifactWriteError(
                f"artifact file name {rel!r} must be relative, inside the artifact, and not {MANIFEST}"
            )
        path = self.tmp / rel
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("wb") as f:
                sink = FileSink(f, self.step, path)
                yield sink
                f.flush()
                self.step("fsync-file")
                self.syncs.start(rel, path, os.dup(f.fileno()))
        except OSError as e:  # ENOSPC, EFBIG, EIO: the file a user can look at is the one named
            raise os_error(e, f"writing {rel} of the artifact {self.dest}", path) from e
        self.files.append(FileRecord(rel, sink.size, sink.digest.hexdigest()))

    def publish(self, manifest: dict[str, Any], verify: Callable[[Path], object] | None = None) -> Path:
        """Write the manifest last, let ``verify`` reopen the finished temp directory (any exception
        stops the publish), then swap the artifact into place atomically."""
        body = dict(manifest)
        body["files"] = [
            {"path": r.path, "size": r.size, "sha256": r.sha256} for r in sorted(self.files, key=lambda r: r.path)
        ]
        body[SELF_DIGEST] = manifest_digest(body)
        for rel, path, e in self.syncs.wait():
            raise os_error(e, f"writing {rel} of the artifact {self.dest}", path) from e
        self.step("manifest")
        with (self.tmp / MANIFEST).open("w") as f:
            json.dump(body, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        self.step("fsync-dir")
        fsync_dir(self.tmp)
        self.step("verify")
        if verify is not None:
            verify(self.tmp)
        self.step("swap")
        check()  # a SIGINT/SIGTERM whose KeyboardInterrupt was lost (qcompiler/interrupt.py)
        self.old = self.swap_into_place()
        self.published = True
        fsync_dir(self.dest.parent)
        self.step("cleanup")
        if self.old is not None:
            remove_path(self.old)
            self.old = None
        return self.dest

    def swap_into_place(self) -> Path | None:
        """Put the temp directory at ``dest``; returns where what it displaced now is (to remove), once
        that proved ours to replace; otherwise it is put back and ``OutputError`` raised."""
        if not os.path.lexists(self.dest):
            try:
                os.rename(self.tmp, self.dest)
                return None
            except OSError as e:  # something appeared meanwhile: exchange with it, then look at it
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise
        if exchange(self.tmp, self.dest):
            old = self.tmp
        else:
            old = self.leftover_name("old")
            os.rename(self.dest, old)
            try:
                os.rename(self.tmp, self.dest)
            except OSError:
                os.rename(old, self.dest)  # put the previous content back
                raise
        try:
            ok, found = describe(old)
        except ArtifactWriteError as e:
            ok, found = False, str(e)
        if ok or self.lock.forced:
            return old
        if old == self.tmp:
            exchange(self.tmp, self.dest)
        else:
            os.rename(self.dest, self.tmp)
            os.rename(old, self.dest)
        raise refusal(self.dest, f"{found}, put there while the artifact was written")


def verify_published(dest: Path) -> dict[str, Any]:
    """Re-read a published artifact's files against its manifest (sizes, sha256, nothing extra or
    missing); returns the manifest. Raises ``ArtifactWriteError`` naming the file and field."""
    manifest_path = dest / MANIFEST
    if not manifest_path.is_file():
        raise ArtifactWriteError(f"{dest}: no {MANIFEST}, so this is not a published artifact")
    manifest = json.loads(manifest_path.read_text())
    listed = {f["path"]: f for f in manifest.get("files", [])}
    present = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()} - {MANIFEST}
    for extra in sorted(present - set(listed)):
        raise ArtifactWriteError(f"{dest / extra}: file is not listed in {MANIFEST}")
    for rel, entry in sorted(listed.items()):
        path = dest / rel
        if not path.is_file():
            raise ArtifactWriteError(f"{path}: listed in {MANIFEST} but missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise ArtifactWriteError(f"{path}: size (expected {entry['size']}, found {size})")
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        if digest.hexdigest() != entry["sha256"]:
            raise ArtifactWriteError(f"{path}: sha256 (expected {entry['sha256']}, found {digest.hexdigest()})")
    return manifest

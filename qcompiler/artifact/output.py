"""The output path is the user's: what may be replaced, the output's lock, and leftovers.

An output ``OUT`` may be replaced when it is absent, an empty directory, or one of our artifacts (a
``manifest.json`` that ``read_manifest`` accepts); a file, a symlink (to a directory too) or any
other directory only with ``force`` (``--force``), else ``OutputError``, nothing touched.

Writers of ``OUT`` are serialised by ``.<OUT name>.lock`` in its parent directory (never inside the
artifact): an exclusive ``flock`` taken without waiting, so a second compile fails at once with
``OutputBusyError`` naming the holder's pid from the file's JSON. The kernel drops a ``flock`` when
its process dies; a lock file whose lock is free is stale and simply reused, and the holder removes
the file when it is done (while still holding it; ``acquire`` re-checks the file's identity).

An interrupted publish (SIGKILL, power loss) leaves ``.<OUT name>.tmp-<pid>-<id>`` (or ``.old-``)
beside ``OUT``: the exact pattern ``LEFTOVER``. Whoever holds ``OUT``'s lock knows no other compile
of ``OUT`` is at work, so every such entry that is not a live writer's of this process is stale and
removed: by every writer of ``OUT`` on entry, by ``claim_output`` and by ``qcompiler clean``.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import TracebackType
from typing import Any

from qcompiler.errors import QcError
from qcompiler.interrupt import Interrupted, deferred

LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|spill)-(?P<pid>[0-9]+)-[0-9a-f]{12}$")
"""Names of the writer's temp and old directories, and compile's blob spill directory, beside output
``name``: the only leftovers removed."""
LOCK_TAG = "qcompiler-output-lock"
MAX_MANIFEST = 64 * 2**20


class ArtifactWriteError(QcError):
    """Writing or publishing an artifact failed; nothing was published and the previous artifact is intact."""


class OutputError(ArtifactWriteError):
    """The output path holds something that is not ours to replace (without ``--force``); nothing was changed."""


class OutputBusyError(OutputError):
    """Another compile holds the output's lock."""


def os_error(e: OSError, doing: str, path: Path | None = None) -> ArtifactWriteError:
    """``e`` as a typed error naming its path (or ``path``), what was being done and the system's reason."""
    where = e.filename or path or "?"
    return ArtifactWriteError(f"{where}: {doing} failed: {e.strerror or e}; nothing was published")


def output_path(dest: Path | str) -> Path:
    """``dest`` with a real last component (``.`` and ``..`` made absolute), as the writer uses it."""
    p = Path(dest)
    p = Path(os.path.abspath(p)) if p.name in ("", "..") else p
    if not p.name:
        raise OutputError(f"{dest}: an artifact cannot replace the filesystem root")
    return p


def describe(path: Path) -> tuple[bool, str]:
    """What is at ``path``, and whether it may be replaced without ``--force``: nothing, an empty
    directory, or one of our artifacts (``not_ours``)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True, "nothing"
    except OSError as e:
        raise os_error(e, "looking at the output path") from e
    if stat.S_ISLNK(st.st_mode):
        return False, f"a symbolic link (to {os.readlink(path)})"
    if not stat.S_ISDIR(st.st_mode):
        return False, f"a regular file of {st.st_size} bytes" if stat.S_ISREG(st.st_mode) else "a special file"
    entries: list[str] = []
    try:
        entries = os.listdir(path)
        why = not_ours(path, entries) if entries else None
    except OSError as e:
        why = f"unreadable: {e.strerror}"
    if why is not None:
        count = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
        return False, f"a directory of {count} that is not a qcompiler artifact ({why})"
    return True, "a qcompiler artifact" if entries else "an empty directory"


def not_ours(path: Path, entries: list[str]) -> str | None:
    """None if ``path`` is an artifact qcompiler wrote (of any schema version, valid or not): its
    ``manifest.json`` has ``versions.artifact_schema`` and a right ``self_sha256``, and it holds no
    file that manifest does not list; else why not. A file of the user's inside is never lost."""
    from qcompiler.artifact.writer import MANIFEST, SELF_DIGEST, SIGNATURE, manifest_digest

    if MANIFEST not in entries:
        return f"no {MANIFEST}"
    with os.fdopen(os.open(path / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
        raw = f.read(MAX_MANIFEST + 1)
    try:
        body: Any = json.loads(raw) if len(raw) <= MAX_MANIFEST else None
    except (ValueError, RecursionError):
        body = None
    versions = body.get("versions") if isinstance(body, dict) else None
    if not isinstance(body, dict) or not isinstance(versions, dict) or "artifact_schema" not in versions:
        return f"{MANIFEST} is not a qcompiler manifest"
    if body.get(SELF_DIGEST) != manifest_digest(body):
        return f"{MANIFEST} is not the one qcompiler wrote: {SELF_DIGEST} does not match"
    files: Any = body.get("files")
    listed = {str(f.get("path")) for f in files if isinstance(f, dict)} if isinstance(files, list) else set[str]()
    extra: list[str] = []
    for dirpath, dirs, names in os.walk(path):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            rel = os.path.relpath(os.path.join(dirpath, name), path)
            if rel not in listed | {MANIFEST, SIGNATURE} or os.path.islink(os.path.join(dirpath, name)):
                extra.append(rel)
    return f"it holds files its {MANIFEST} does not list: {', '.join(sorted(extra)[:5])}" if extra else None


def refusal(dest: Path, found: str) -> OutputError:
    return OutputError(
        f"{dest}: refusing to replace what is there: found {found}, expected nothing, an empty directory or a "
        "qcompiler artifact; nothing was changed. --force replaces it"
    )


def check_parent(dest: Path, access: bool = True) -> None:
    """The nearest existing ancestor of ``dest`` must be a directory (and, with ``access``, one this
    user may write in, as ``os.access`` says: for root that is nearly always yes)."""
    anc = dest.parent
    while not os.path.lexists(anc) and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise ArtifactWriteError(f"{anc}: not a directory, so {dest} cannot be created (expected a directory)")
    if access and not os.access(anc, os.W_OK | os.X_OK):
        raise ArtifactWriteError(f"{anc}: this user cannot write in this directory, so {dest} cannot be published")


HELD: dict[str, list[int]] = {}
"""Output locks this process holds: lock path -> [thread, fd, force, depth]; the thread may re-enter."""
LIVE: set[str] = set()
"""Temp and old directories of this process's writers at work (never leftovers)."""
REGISTRY = threading.Lock()


def leftover_path(dest: Path, kind: str) -> Path:
    """``.<dest name>.<kind>-<pid>-<id>`` beside ``dest`` (the ``LEFTOVER`` pattern), registered as live."""
    path = dest.parent / f".{dest.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    LIVE.add(str(path.absolute()))
    return path


def lock_info(fd: int) -> dict[str, Any]:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        info = None
    return info if isinstance(info, dict) else {"tag": "?"}  # type: ignore[return-value]


def busy(dest: Path, lock: Path, info: dict[str, Any]) -> OutputBusyError:
    since = f", since {info['started']}" if "started" in info else ""
    return OutputBusyError(
        f"{dest}: another compile (pid {info.get('pid', '?')}{since}) is writing this output; wait for it to "
        f"finish or stop that process (its lock {lock} is released when it exits); nothing was changed"
    )


def acquire(dest: Path, lock: Path) -> int:
    """Open (creating) and ``flock`` the lock file, which must still be the one at ``lock`` once locked
    (a finishing holder removes it): two holders never lock two different files."""
    for _ in range(32):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ArtifactWriteError(
                f"{lock.parent}: cannot create the lock {lock.name} of {dest}: {e.strerror}"
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st, now = os.fstat(fd), os.lstat(lock)
        except OSError as e:
            info = lock_info(fd)
            os.close(fd)
            if isinstance(e, BlockingIOError):
                raise busy(dest, lock, info) from None
            if isinstance(e, FileNotFoundError):
                continue  # its holder removed it while we waited for it: take the new one
            raise os_error(e, f"locking {lock}") from e
        if not os.path.samestat(st, now):
            os.close(fd)
            continue
        if not stat.S_ISREG(st.st_mode) or (st.st_size and lock_info(fd).get("tag") != LOCK_TAG):
            os.close(fd)
            raise OutputError(f"{lock}: exists and is not a qcompiler lock file; nothing was changed")
        info = {"tag": LOCK_TAG, "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        return fd
    raise OutputBusyError(f"{lock}: the lock keeps being replaced by other compiles of {dest}; try again")


class OutputLock:
    """Holds the output's lock (see the module docstring) until the block ends. The thread holding it
    may enter again (``qcompiler compile`` holds it around the whole compile, its writer inside);
    ``forced`` is whether a holder in that thread said ``--force``."""

    def __init__(self, dest: Path | str, force: bool = False) -> None:
        self.dest = output_path(dest)
        self.path = self.dest.parent / f".{self.dest.name}.lock"
        self.key, self.force, self.forced = str(self.path.absolute()), force, force

    def __enter__(self) -> OutputLock:
        with REGISTRY:
            held, me = HELD.get(self.key), threading.get_ident()
            if held is None:
                try:
                    with deferred():  # a signal between the lock file's creation and HELD would leave it
                        HELD[self.key] = [me, acquire(self.dest, self.path), self.force, 1]
                except Interrupted:
                    if self.key in HELD:
                        self.release(HELD.pop(self.key))
                    raise
            elif held[0] != me:
                raise busy(self.dest, self.path, {"pid": os.getpid()})
            else:
                held[3] += 1
                self.forced = bool(held[2]) or self.force
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        with REGISTRY:
            held = HELD[self.key]
            held[3] -= 1
            if held[3] == 0:
                del HELD[self.key]
                self.release(held)

    def release(self, held: list[Any]) -> None:
        try:
            if os.path.samestat(os.fstat(held[1]), os.lstat(self.path)):
                os.unlink(self.path)  # while still locked: see acquire
        finally:
            os.close(held[1])


def remove_path(path: Path) -> None:
    """Remove a directory tree, or a file or symlink (never following it)."""
    try:
        shutil.rmtree(path) if stat.S_ISDIR(os.lstat(path).st_mode) else os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise os_error(e, "removing a leftover") from e


def leftovers(dest: Path | str) -> list[Path]:
    """Temp and old directories interrupted publishes of ``dest`` left beside it (the exact naming, not
    a live writer's of this process); stale while the caller holds the output's lock."""
    dest = output_path(dest)
    try:
        names = sorted(os.listdir(dest.parent))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        raise os_error(e, "listing the output's directory") from e
    matches = [(LEFTOVER.match(n), dest.parent / n) for n in names]
    return [p for m, p in matches if m and m["name"] == dest.name and str(p.absolute()) not in LIVE]


def remove_leftovers(dest: Path | str, dry_run: bool = False) -> list[Path]:
    """Take the output's lock (``OutputBusyError`` while a compile holds it), then remove (with
    ``dry_run`` only list) its stale leftovers."""
    with OutputLock(dest) as lock:
        found = leftovers(lock.dest)
        for path in [] if dry_run else found:
            remove_path(path)
    return found


@contextmanager
def claim_output(dest: Path | str, force: bool = False) -> Generator[Path]:
    """Before the slow work: the output's directory must be writable and the output ours to replace
    (or ``force``). While the block runs, the output's lock is held (when its directory exists; a
    writer inside inherits ``force`` and checks again) and its stale leftovers are gone."""
    path = output_path(dest)
    check_parent(path)
    with OutputLock(path, force) if path.parent.is_dir() else nullcontext():
        ok, found = describe(path)
        if not ok and not force:
            raise refusal(path, found)
        for p in leftovers(path):
            remove_path(p)
        yield path

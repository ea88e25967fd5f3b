"""The path policy: which files a reader may open under a root, written once and used by every reader.

A path inside an artifact (a manifest entry, an ONNX external-data location, a ``graph.qir`` blob
location) and a file of a source directory are opened only through this module:

| rule | artifact (``ARTIFACT``) | source directory (``SOURCE``) |
|---|---|---|
| relative, ``/``-separated, no ``..``/``.``/empty part, no NUL, backslash or drive | yes | yes |
| symbolic links (files or directories) below the root | refused | only inside the root (1) |
| hard-linked files (``st_nlink > 1``) | refused | allowed |
| anything but regular files and directories | refused | refused |
| identity after open (``fstat`` of the opened descriptor) | checked | checked |

(1) or, for an HF cache snapshot (``.../models--x/snapshots/<revision>``), inside its ``models--x``
folder, where the snapshot's links point at ``blobs/``.

``open_in`` walks the components with ``O_NOFOLLOW`` (and ``O_DIRECTORY`` for parents) relative to
the previous descriptor, so no link is followed between the check and the open, then checks the
opened descriptor itself. ``walk`` lists a whole tree under the policy (the artifact's unlisted-file
gate), and ``Identity`` lets a reader that opens a file again later (a memory map, a tensor read) prove
it is still the file that was checked. Every refusal is a ``PathError`` naming the file and the rule.

    fh, st = open_in(root, "model.safetensors")          # checked, opened, fstat'ed
    files = walk(root)                                   # {"model.safetensors": stat, ...}
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

from qcompiler.errors import FileError

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
DIRECTORY = getattr(os, "O_DIRECTORY", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DRIVE = re.compile(r"^[A-Za-z]:")
MAX_DEPTH = 16
"""Deepest directory nesting a walk follows (an artifact uses one level: ``kernels/``)."""
MAX_ENTRIES = 100_000
"""Most directory entries a walk reads before it refuses the tree."""


class PathError(FileError):
    """A path breaks the path policy: it escapes the root, passes through a link, is a hard link or
    a special file, or changed identity between two opens."""


@dataclass(frozen=True)
class Policy:
    """What a tree may contain besides plain files and directories (see the module docstring)."""

    name: str
    symlinks: Literal["refuse", "inside"] = "refuse"
    hardlinks: bool = False


ARTIFACT = Policy("artifact")
SOURCE = Policy("source", symlinks="inside", hardlinks=True)


@dataclass(frozen=True)
class Identity:
    """Which file a descriptor was: device, inode, size and modification time."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @staticmethod
    def of(st: os.stat_result) -> Identity:
        return Identity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_rel(rel: object, *, file: str = "", field: str = "path", noun: str = "path") -> str:
    """``rel`` if it is a lexically safe relative path (see the table), else ``PathError`` (whose
    message starts with ``noun``: ``path``, ``location``)."""
    shown = file or repr(rel)

    def fail(message: str) -> PathError:
        return PathError(
            f"{noun} {message}", file=shown, field=field, expected="a relative path inside the root", found=repr(rel)
        )

    if not isinstance(rel, str) or not rel:
        raise fail("is empty or not a string")
    if "\0" in rel:
        raise fail("contains a NUL byte")
    if "\\" in rel:
        raise fail("contains a backslash")
    if rel.startswith("/") or os.path.isabs(rel):
        raise fail("is an absolute path")
    if DRIVE.match(rel):
        raise fail("starts with a drive letter")
    parts = rel.split("/")
    if ".." in parts:
        raise fail("has a '..' component")
    if any(p in ("", ".") for p in parts):
        raise fail("has an empty or '.' component")
    return rel


def _mode_error(rel: str, st: os.stat_result, field: str) -> PathError:
    return PathError(
        "is not a regular file", file=rel, field=field, expected="a regular file", found=stat.filemode(st.st_mode)
    )


def _check_regular(rel: str, st: os.stat_result, policy: Policy, field: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise _mode_error(rel, st, field)
    if st.st_nlink > 1 and not policy.hardlinks:
        raise PathError(
            f"has {st.st_nlink} hard links: a file of an {policy.name} may not be shared with a file elsewhere",
            file=rel,
            field=field,
            expected="1 link",
            found=st.st_nlink,
        )


def allowed_root(root: Path) -> Path:
    """The folder a source's symbolic links may resolve into: the root itself, or the ``models--*``
    repository folder when the root is an HF cache snapshot (``.../snapshots/<revision>``)."""
    real = Path(os.path.realpath(root))
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--")):
        return real.parent.parent
    return real


def _open_resolved(root: Path, rel: str, policy: Policy, field: str) -> tuple[BinaryIO, os.stat_result]:
    """A source file whose links resolve inside ``allowed_root``: resolve, check, open the target
    with ``O_NOFOLLOW`` and compare it with what was resolved."""
    before = _link_target(root, rel)
    target = Path(os.path.realpath(root / rel))
    try:
        fd = os.open(target, os.O_RDONLY | NOFOLLOW | NONBLOCK | CLOEXEC)
    except OSError as e:
        raise PathError("cannot be opened", file=rel, field=field, found=e.strerror or type(e).__name__) from None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        raise PathError("changed while it was opened", file=rel, field=field)
    return _finish(fd, rel, st, policy, field)


def _finish(fd: int, rel: str, st: os.stat_result, policy: Policy, field: str) -> tuple[BinaryIO, os.stat_result]:
    try:
        _check_regular(rel, st, policy, field)
        if NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb"), st


def open_in(
    root: Path | str, rel: str, policy: Policy = ARTIFACT, *, field: str = "path", expect: Identity | None = None
) -> tuple[BinaryIO, os.stat_result]:
    """Open ``root/rel`` for reading under ``policy``; returns the file and the ``fstat`` of its
    descriptor. ``expect``: the identity the file must still have (from an earlier ``walk``)."""
    root = Path(root)
    check_rel(rel, file=rel, field=field)
    if policy.symlinks == "inside" and _has_link(root, rel):
        fh, st = _open_resolved(root, rel, policy, field)
    else:
        fh, st = _open_nofollow(root, rel, policy, field)
    if expect is not None and Identity.of(st) != expect:
        fh.close()
        raise PathError(
            "changed between two checks (another file, or other contents)",
            file=rel,
            field=field,
            expected=expect,
            found=Identity.of(st),
        )
    return fh, st


def _has_link(root: Path, rel: str) -> bool:
    path = root
    for part in rel.split("/"):
        path = path / part
        if path.is_symlink():
            return True
    return False


def _open_nofollow(root: Path, rel: str, policy: Policy, field: str) -> tuple[BinaryIO, os.stat_result]:
    parts = rel.split("/")
    try:
        dirfd = os.open(root, os.O_RDONLY | DIRECTORY | CLOEXEC)
    except OSError as e:
        raise PathError("the root cannot be opened", file=str(root), found=e.strerror or type(e).__name__) from None
    try:
        for i, part in enumerate(parts[:-1]):
            try:
                nxt = os.open(part, os.O_RDONLY | DIRECTORY | NOFOLLOW | CLOEXEC, dir_fd=dirfd)
            except OSError as e:
                raise _component_error(dirfd, part, "/".join(parts[: i + 1]), rel, field, e, directory=True) from None
            os.close(dirfd)
            dirfd = nxt
        try:
            fd = os.open(parts[-1], os.O_RDONLY | NOFOLLOW | NONBLOCK | CLOEXEC, dir_fd=dirfd)
        except OSError as e:
            raise _component_error(dirfd, parts[-1], rel, rel, field, e, directory=False) from None
    finally:
        os.close(dirfd)
    return _finish(fd, rel, os.fstat(fd), policy, field)


def _component_error(
    dirfd: int, part: str, upto: str, rel: str, field: str, e: OSError, *, directory: bool
) -> PathError:
    try:
        st = os.stat(part, dir_fd=dirfd, follow_symlinks=False)
    except OSError:
        return PathError("is missing", file=rel, field=field, found=f"no {upto!r}")
    if stat.S_ISLNK(st.st_mode):
        what = "passes through a symbolic link directory" if directory else "is a symbolic link"
        return PathError(what, file=rel, field=field, expected="no links", found=f"{upto!r} is a link")
    if directory and not stat.S_ISDIR(st.st_mode):
        return PathError("a parent is not a directory", file=rel, field=field, found=repr(upto))
    return PathError("cannot be opened", file=rel, field=field, found=e.strerror or type(e).__name__)


def reopen(path: Path, identity: Identity) -> BinaryIO:
    """Open ``path`` again (``O_NOFOLLOW``) and prove it is still the file ``identity`` describes: a
    container reader that reads tensors long after its header was checked calls this for each read."""
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW | CLOEXEC)
    except OSError as e:
        raise PathError("cannot be opened again", file=str(path), found=e.strerror or type(e).__name__) from None
    found = Identity.of(os.fstat(fd))
    if found != identity:
        os.close(fd)
        raise PathError(
            "is not the file that was checked (replaced or modified since it was opened)",
            file=str(path),
            field="identity",
            expected=identity,
            found=found,
        )
    return os.fdopen(fd, "rb")


def read_bounded(root: Path | str, rel: str, limit: int, policy: Policy = ARTIFACT, *, field: str = "path") -> bytes:
    """The whole of ``root/rel`` (opened by ``open_in``), refused if it is over ``limit`` bytes."""
    fh, st = open_in(root, rel, policy, field=field)
    with fh:
        if st.st_size > limit:
            raise PathError("too large", file=rel, field="size", expected=f"<= {limit} bytes", found=st.st_size)
        data = fh.read(st.st_size + 1)
    if len(data) != st.st_size:
        raise PathError("changed size while it was read", file=rel, field="size", expected=st.st_size, found=len(data))
    return data


def sha256_in(root: Path | str, rel: str, policy: Policy = ARTIFACT) -> str:
    """sha256 (hex) of ``root/rel``, opened by ``open_in`` and streamed in 1 MiB chunks."""
    import hashlib

    fh, _ = open_in(root, rel, policy)
    digest = hashlib.sha256()
    with fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def walk(root: Path | str, policy: Policy = ARTIFACT) -> dict[str, os.stat_result]:
    """Every regular file under ``root`` (relative posix path -> ``lstat``), refusing what ``policy``
    refuses: links, hard links, special files; bounded in depth and entry count."""
    root = Path(root)
    out: dict[str, os.stat_result] = {}
    count = 0
    for rel, st in _entries(root, "", 0):
        count += 1
        if count > MAX_ENTRIES:
            raise PathError("too many files", file=str(root), expected=f"<= {MAX_ENTRIES} entries", found=count)
        if stat.S_ISLNK(st.st_mode):
            if policy.symlinks == "refuse":
                raise PathError(
                    f"is a symbolic link: an {policy.name} may not contain links",
                    file=rel,
                    expected="a regular file or directory",
                    found="a symbolic link",
                )
            st = _link_target(root, rel)
            if stat.S_ISDIR(st.st_mode):
                continue
        _check_regular(rel, st, policy, "path")
        out[rel] = st
    return out


def _link_target(root: Path, rel: str) -> os.stat_result:
    """The ``stat`` of what a source's link points at, refused unless it resolves inside ``allowed_root``."""
    target = Path(os.path.realpath(root / rel))
    fence = allowed_root(root)
    if not target.is_relative_to(fence):
        raise PathError(
            "resolves outside the source directory", file=rel, expected=f"inside {fence.name}", found=target.name
        )
    try:
        return os.stat(target)
    except OSError as e:
        raise PathError("is a dangling link", file=rel, found=e.strerror or type(e).__name__) from None


def _entries(root: Path, prefix: str, depth: int) -> Iterator[tuple[str, os.stat_result]]:
    if depth > MAX_DEPTH:
        raise PathError("directories nested too deep", file=prefix, expected=f"<= {MAX_DEPTH} levels", found=depth)
    try:
        with os.scandir(root / prefix if prefix else root) as it:
            items = sorted((e.name, e.stat(follow_symlinks=False)) for e in it)
    except OSError as e:
        raise PathError("cannot list", file=prefix or str(root), found=e.strerror or type(e).__name__) from None
    for name, st in items:
        rel = f"{prefix}/{name}" if prefix else name
        if stat.S_ISDIR(st.st_mode):
            yield from _entries(root, rel, depth + 1)
        else:
            yield rel, st

"""Where tensor bytes live, and how a lazy ``BlobRef`` is turned into bytes.

Locations are ``scheme`` or ``scheme:rest``; each scheme is one reader in ``READERS``:

| location | bytes come from |
|---|---|
| ``mem`` | this process's blob store, keyed by sha256 (``put_array``; inside ``spilled(DIR)``: ``DIR/<sha256>``) |
| ``file:REL`` / ``file:REL@OFFSET`` | raw little-endian bytes in a file relative to the IR file's directory |
| ``safetensors:FILE#TENSOR`` | one tensor of a safetensors file, read through the strict container reader |
| ``ct-zero:FILE#TENSOR@BITS`` | compressed-tensors zero points packed along dim 0, unpacked to one per byte |
| ``gguf:FILE#TENSOR@PART`` | one logical part (codes, scale, values) of a GGUF tensor's blocks |
| ``onnx:FILE#INITIALIZER@VIEW`` | an ONNX initializer's bytes (external data checked), unpacked by views |

A spilled blob an artifact file holds is read from that file from then on (``blob_spill.moved``).

Backend schemes are imported on first use: each backend declares its own (``BLOB_SCHEMES``,
``qcompiler.plugins``).

Every read checks the length against dtype x shape and the sha256 before returning, except a read
this process has checked already: a store blob it hashed as it stored it (``hashed_here``), or the
same location read again from files of the same identity (path, device, inode, size, mtime) as when
its sha256 was checked. A reopened 1.1B artifact's weights are read by the verifier, the ladder and
the graph probe: 2.3 GB of hashing, once instead of three times. Files changed in place with their
mtime put back are not caught here; the writer's last check hashes every file before publishing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import threading
import weakref
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

import numpy as np

from qcompiler import plugins
from qcompiler.errors import BlobError, QcError
from qcompiler.ir import blob_spill
from qcompiler.ir.blob_spill import SPILLS
from qcompiler.ir.core import BlobRef, Module, TensorDecl
from qcompiler.ir.dtypes import DType

_MEMORY: dict[str, bytes] = {}
_FROM_STORE: dict[int, tuple[weakref.ref[np.ndarray], str]] = {}
"""id -> (weak ref, sha256) of each read-only array ``read_array`` made from a blob of the store."""
_DERIVED: dict[str, tuple[Path, Callable[[], np.ndarray]]] = {}
"""sha256 -> (spill directory, recipe) of each blob ``derived`` keeps as a recipe instead of bytes."""
FileIdentity = tuple[str, int, int, int, int]
"""(absolute path, device, inode, size, mtime_ns) of a file as it was opened."""
_OPENED = threading.local()
"""``files``: while ``read_blob`` runs a reader on this thread, the identity of each file it opened."""
_VERIFIED: dict[tuple[str, str, str, tuple[FileIdentity, ...]], None] = {}
"""(location, base, sha256, files opened) of each file-backed read whose sha256 was checked."""
MAX_VERIFIED = 1 << 16

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
Reader = Callable[[BlobRef, str, Path], bytes | memoryview]
READERS: dict[str, Reader] = {}


def registrar(table: dict[str, F], scheme: str) -> Callable[[F], F]:
    """A decorator putting a function in ``table`` under ``scheme`` (``reader``, ``pieces``)."""

    def register(fn: F) -> F:
        table[scheme] = fn
        return fn

    return register


def reader(scheme: str) -> Callable[[Reader], Reader]:
    return registrar(READERS, scheme)


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def keep_bytes(digest: str, data: bytes | memoryview) -> None:
    """Store ``data``, whose sha256 is ``digest`` (the caller hashed it), in memory or the spill."""
    if SPILLS:
        blob_spill.keep(digest, data)
    else:
        _MEMORY[digest] = bytes(data)


@contextlib.contextmanager
def spilled(directory: Path) -> Generator[Path]:
    """Inside this block the blob store keeps new blobs in ``directory`` (one file per sha256), not in
    memory: a compile's memory then follows its largest tensor, not the model. Blobs made here are
    readable until the block ends; the caller owns (and removes) ``directory``. A spilled blob an
    artifact file now holds is read from there (``blob_spill.moved``)."""
    directory.mkdir(parents=True, exist_ok=True)
    SPILLS.append(directory)
    try:
        yield directory
    finally:
        blob_spill.leave(directory)
        for sha in [k for k, (d, _) in _DERIVED.items() if d == directory]:
            del _DERIVED[sha]


def spill_active() -> bool:
    """Whether new blobs go to a spill directory (``spilled``), readable by other processes."""
    return bool(SPILLS)


def in_store(sha: str) -> bool:
    return sha in _MEMORY or sha in _DERIVED or blob_spill.in_spill(sha)


def put_array(arr: np.ndarray, dtype: DType) -> BlobRef:
    """Store ``arr`` (cast to ``dtype``'s numpy container, little-endian) in memory; return its ref.
    An array ``read_array`` returned from the store, stored again as it is, is not hashed again."""
    ref, data = hashed(arr, dtype)
    if data is not None:
        keep_bytes(ref.sha256, data)
    return ref


def hashed(arr: np.ndarray, dtype: DType) -> tuple[BlobRef, memoryview | None]:
    """``put_array``'s reference for ``arr`` and the bytes still to store (``None``: the store holds
    them already), before anything is stored: ``keep_bytes`` stores them, or ``derived`` a recipe."""
    data = np.ascontiguousarray(arr, dtype=np.dtype(dtype.numpy).newbyteorder("<"))
    known = _FROM_STORE.get(id(arr))
    same = known is not None and known[0]() is arr and data.dtype == arr.dtype and arr.flags.c_contiguous
    ref = BlobRef(dtype, tuple(int(d) for d in arr.shape), known[1] if known is not None and same else "", "mem")
    if ref.sha256:
        return ref, None
    view = memoryview(data.reshape(-1).view(np.uint8))  # pyright: ignore[reportArgumentType]
    return dataclasses.replace(ref, sha256=sha256_hex(view)), view


def byte_view(arr: np.ndarray) -> memoryview:
    """The bytes of ``arr`` (made C-contiguous: a copy only if it is not) as a flat read-only view, not
    a copy: what a reader hands out when the array is memory it owns."""
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return memoryview(flat).toreadonly()  # pyright: ignore[reportArgumentType]


def derived(ref: BlobRef, make: Callable[[], np.ndarray]) -> None:
    """Keep blob ``ref`` as a recipe instead of bytes while a spill directory is active: ``make()``
    gives its array again when something reads it (checked against its sha256, like any read). A
    streamed weight's logical codes, for one, are made again from its packed codes if ever read;
    unspilled, 1.1 GB at 1.1B parameters are never written. Without a spill the bytes are kept."""
    if not SPILLS:
        put_array(make(), ref.dtype)
        return
    _DERIVED[ref.sha256] = (SPILLS[-1], make)


def _derived_bytes(ref: BlobRef) -> memoryview | None:
    """A recipe's array as a read-only view of its bytes, not a copy (a 1 GB embedding a recipe reads
    from its source is then held once); a recipe gives memory it owns, never a file's map."""
    recipe = _DERIVED.get(ref.sha256)
    if recipe is None:
        return None
    return byte_view(np.asarray(recipe[1](), dtype=np.dtype(ref.dtype.numpy).newbyteorder("<")))


@reader("mem")
def _read_mem(ref: BlobRef, rest: str, base: Path) -> bytes | memoryview:
    data = _MEMORY.get(ref.sha256)
    if data is None:
        data = blob_spill.spilled_bytes(ref.sha256, ref.nbytes)
    if data is None:
        data = _derived_bytes(ref)  # not hashed here: ``read_blob`` checks the sha256
    if data is None:
        raise BlobError(
            f"in-memory blob sha256:{ref.sha256[:16]}… is not in this process (it lives only where it was made)"
        )
    return data


def open_blob_file(base: Path, rel: str, what: str) -> tuple[BinaryIO, os.stat_result]:
    """``base/rel`` opened under the artifact path policy (``qcompiler.paths``): relative,
    inside ``base``, no links of any kind, a regular file; a refusal is a ``BlobError``."""
    from qcompiler.paths import PathError, open_in

    try:
        fh, st = open_in(base, rel, field=f"{what} location")
    except PathError as e:
        raise BlobError(f"{what} location {rel!r}: {e.message}") from None
    seen: list[FileIdentity] | None = getattr(_OPENED, "files", None)
    if seen is not None:
        seen.append((str((base / rel).absolute()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return fh, st


@reader("file")
def _read_file(ref: BlobRef, rest: str, base: Path) -> bytes:
    rel, _, offset_s = rest.partition("@")
    if offset_s and not offset_s.isdigit():
        raise BlobError(f"file offset must be a decimal integer, found {offset_s!r}")
    fh, st = open_blob_file(base, rel, "file")
    with fh:
        size = st.st_size
        if not offset_s and size != ref.nbytes:
            raise BlobError(f"{rel} holds {size} bytes, but the tensor needs exactly {ref.nbytes}")
        offset = int(offset_s or 0)
        if offset + ref.nbytes > size:
            raise BlobError(f"{rel} holds {size} bytes, but the tensor needs bytes {offset}..{offset + ref.nbytes}")
        try:
            fh.seek(offset)
            return fh.read(ref.nbytes)
        except OSError as e:
            raise BlobError(f"cannot read {rel}: {e.strerror}") from None


_PARSED: dict[tuple[str, str, int, int, int, int], object] = {}
MAX_PARSED = 64
"""Container headers kept per process by ``open_cached`` (small; the tensor bytes stay on disk)."""
_PARSED_LOCK = threading.Lock()


def open_cached(base: Path, rel: str, what: str, open_fn: Callable[..., T]) -> T:
    """``open_fn(base / rel, fh=FILE)``, once per scheme and file identity (path, device, inode, size,
    mtime; the scheme too, so a location naming another format's parser never gets this one's): a
    backend scheme's container, parsed and gated once however many tensors a graph reads from it.
    The file is opened under the artifact path policy first (``open_blob_file``) and the parser reads
    that descriptor; a ``QcError`` from ``open_fn`` becomes a ``BlobError``."""
    fh, st = open_blob_file(base, rel, what)
    with fh:
        path = base / rel
        key = (what, str(path.absolute()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        parsed = _PARSED.get(key)
        if parsed is None:
            try:
                parsed = open_fn(path, fh=fh)
            except QcError as e:
                raise BlobError(str(e)) from None
            with _PARSED_LOCK:  # the data checks open files from several threads (``DataChecker.run``)
                if len(_PARSED) >= MAX_PARSED:
                    _PARSED.clear()
                _PARSED[key] = parsed
    return cast(T, parsed)  # not read back: another thread may have cleared the table since


Pieces = Callable[[BlobRef, str, Path], Iterator["bytes | memoryview"]]
PIECES: dict[str, Pieces] = {}
"""Schemes that can also give a blob's bytes a piece at a time (``check_blob``), registered with ``pieces``."""


def pieces(scheme: str) -> Callable[[Pieces], Pieces]:
    return registrar(PIECES, scheme)


def check_blob(decl: TensorDecl, base_dir: str = "") -> None:
    """``read_blob``'s checks (length, sha256) without keeping the bytes: a scheme in ``PIECES`` is read
    and hashed a few MB at a time, so checking an 8B model's 1 GB embedding does not hold it."""
    for _ in read_pieces(decl, base_dir):
        pass


def read_blob(decl: TensorDecl, base_dir: str = "") -> bytes | memoryview:
    """The bytes of ``decl``, after checking length and sha256. Raises ``BlobError`` naming the tensor."""
    ref, where, read, rest, base = _resolve(decl, base_dir)
    outer: list[FileIdentity] | None = getattr(_OPENED, "files", None)
    opened: list[FileIdentity] = []
    _OPENED.files = opened
    try:
        data = read(ref, rest, base)
    except BlobError as e:
        raise BlobError(f"{where}: {e}") from None
    finally:
        _OPENED.files = outer
        if outer is not None:
            outer.extend(opened)  # a reader that reads another blob read those files too
    _check_length(where, ref, len(data))
    key = (ref.location, str(base.absolute()), ref.sha256, tuple(opened))
    if not (ref.location == "mem" and hashed_here(ref.sha256)) and not (opened and key in _VERIFIED):
        _check_digest(where, ref, sha256_hex(data), key)
    return data


def read_pieces(decl: TensorDecl, base_dir: str = "") -> Iterator[bytes | memoryview]:
    """``read_blob``'s bytes a few MB at a time where the scheme reads pieces (``PIECES``; else whole),
    length and sha256 checked as they go (a wrong one: ``BlobError`` after the last piece), not hashed
    from a file a hash was taken of (``vouch``): a writer copies an 8B model's 1 GB head in pieces."""
    ref, where, _, rest, base = _resolve(decl, base_dir)
    piecewise = PIECES.get(ref.location.partition(":")[0])
    if piecewise is None:
        yield read_blob(decl, base_dir)
        return
    outer: list[FileIdentity] | None = getattr(_OPENED, "files", None)
    opened: list[FileIdentity] = []
    sha, size, trusted = hashlib.sha256(), 0, None
    it = piecewise(ref, rest, base)
    while True:
        _OPENED.files = opened  # only while the reader runs: the caller reads other blobs between pieces
        try:
            piece = next(it, None)
        except BlobError as e:
            raise BlobError(f"{where}: {e}") from None
        finally:
            _OPENED.files = outer
        if piece is None:
            break
        if trusted is None:  # the file is open now: its identity decides once
            trusted = bool(opened) and (ref.location, str(base.absolute()), ref.sha256, tuple(opened)) in _VERIFIED
        if not trusted:
            sha.update(piece)
        size += len(piece)
        yield piece
    if outer is not None:
        outer.extend(opened)
    _check_length(where, ref, size)
    if not trusted:
        _check_digest(where, ref, sha.hexdigest(), (ref.location, str(base.absolute()), ref.sha256, tuple(opened)))


def _resolve(decl: TensorDecl, base_dir: str) -> tuple[BlobRef, str, Reader, str, Path]:
    """``decl``'s ref, how errors name it, its scheme's reader (its plugin loaded), the rest, the base."""
    ref = decl.blob
    scheme, _, rest = ref.location.partition(":")
    if scheme not in READERS and scheme in plugins.declared("BLOB_SCHEMES"):
        plugins.provide(plugins.declared("BLOB_SCHEMES")[scheme])
    fn = READERS.get(scheme)
    where = f"tensor @{decl.name}"
    if fn is None:
        raise BlobError(f"{where}: unknown location scheme {scheme!r} (known: {', '.join(READERS)})")
    return ref, where, fn, rest, Path(base_dir or ".")


def _check_length(where: str, ref: BlobRef, size: int) -> None:
    if size != ref.nbytes:
        raise BlobError(f"{where}: wrong byte length (expected {ref.nbytes}, found {size})")


def _check_digest(where: str, ref: BlobRef, digest: str, key: tuple[str, str, str, tuple[FileIdentity, ...]]) -> None:
    """``digest`` must be the ref's sha256; once it is, a read of the same files need not hash it again."""
    if digest != ref.sha256:
        raise BlobError(f"{where}: sha256 mismatch (expected {ref.sha256}, found {digest})")
    if key[3]:
        if len(_VERIFIED) >= MAX_VERIFIED:
            _VERIFIED.clear()
        _VERIFIED[key] = None


def vouch(location: str, base_dir: str, rel: str, sha: str, st: os.stat_result) -> None:
    """Blob ``location`` (a scheme that reads it from file ``rel`` under ``base_dir`` alone) holds
    bytes of sha256 ``sha``: the caller hashed them as it read ``rel``, which was ``st`` (the same
    identity) from open to close. Reading the location from that file again checks the identity,
    not the bytes: a streamed compile's dense tensors, hashed as the stream read them, are then not
    hashed again by the writer and by the graph probe (a 1.1B model: 0.26 GB each)."""
    base = Path(base_dir or ".")
    ident = (str((base / rel).absolute()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if len(_VERIFIED) >= MAX_VERIFIED:
        _VERIFIED.clear()
    _VERIFIED[(location, str(base.absolute()), sha, (ident,))] = None


def hashed_here(sha: str) -> bool:
    """Whether the store's blob ``sha`` is bytes this process hashed as it stored them, unchanged
    since: held in memory (immutable), or a spill file of the size and mtime it was written with.
    Reading it back needs no second sha256 (at 1.1B parameters, 5 GB of hashing per compile)."""
    return sha in _MEMORY or blob_spill.written_here(sha)


def read_array(m: Module, name: str) -> np.ndarray:
    """The tensor-table entry ``name`` of ``m`` as a numpy array (bf16 as raw uint16)."""
    decl = m.tensors[name]
    data = read_blob(decl, m.base_dir)
    arr = np.frombuffer(data, dtype=np.dtype(decl.blob.dtype.numpy).newbyteorder("<")).reshape(decl.blob.shape)
    if decl.blob.location == "mem" and not arr.flags.writeable:
        key = id(arr)
        _FROM_STORE[key] = (weakref.ref(arr, lambda _: _FROM_STORE.pop(key, None)), decl.blob.sha256)
    return arr


def read_float32(m: Module, name: str) -> np.ndarray:
    """A float tensor-table entry as float32 values (bf16 bits widened exactly; f64 narrowed)."""
    return as_float32(read_array(m, name), m.tensors[name].blob.dtype.name)


def as_float32(arr: np.ndarray, dtype: str) -> np.ndarray:
    """Stored float values of IR dtype ``dtype`` as float32 (bf16 bits widened exactly; f64 narrowed)."""
    if dtype == "bf16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def store(m: Module, name: str, arr: np.ndarray, dtype: DType, attrs: dict[str, Any] | None = None) -> None:
    """Set tensor ``name`` of ``m`` to ``arr``. When the bytes equal the current entry's (same sha256)
    the entry is kept as it is, location included, so unchanged tensors stay where they live."""
    bind(m, name, put_array(arr, dtype), attrs)


def bind(m: Module, name: str, ref: BlobRef, attrs: dict[str, Any] | None = None) -> None:
    """``store`` of bytes already in the store as ``ref``."""
    old = m.tensors.get(name)
    if old is not None and old.blob == dataclasses.replace(ref, location=old.blob.location):
        return
    m.tensors[name] = TensorDecl(name, ref, dict(attrs if attrs is not None else (old.attrs if old else {})))

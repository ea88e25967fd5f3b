"""Our safetensors container codec: a canonical writer and a strict, bounded reader for untrusted files.

A file is ``[u64 LE N][N bytes of UTF-8 JSON header][byte buffer]``. The header maps each tensor name to
``{"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}`` (offsets into the buffer, end exclusive,
little-endian C-order data) plus an optional ``"__metadata__": {str: str}``.

Writer: byte-identical to the reference (``safetensors.serialize``): tensors ordered by dtype alignment
descending, then name; compact JSON with ``__metadata__`` first and the tensors in offset order; header padded
with spaces to a multiple of 8. One difference: metadata keys are written sorted (the reference writes them in
Rust hash-map order, which changes from run to run).

Reader: accepts what the reference accepts, except what the format README disallows and the reference lets
through: a header not starting with ``{``, duplicate JSON keys, an empty tensor name, keys other than
``dtype``/``shape``/``data_offsets`` in an entry. Every number is checked before it sizes a read or an
allocation; every rejection is a :class:`ContainerError` naming the file, tensor, field, expected and found.

The writer half lives in ``container_write.py`` (``TensorBytes``, ``layout``, ``serialize``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeGuard

import numpy as np
import numpy.typing as npt

from qcompiler.errors import FileError
from qcompiler.paths import Identity, reopen

MAX_HEADER_BYTES = 100_000_000
MAX_NAME_BYTES = 1024
MAX_RANK = 8
METADATA_KEY = "__metadata__"
ENTRY_KEYS = ("dtype", "shape", "data_offsets")
WRITER = "<writer>"

# safetensors dtype -> (bits per element, numpy dtype of the raw storage or None for sub-byte dtypes).
# Declared in the reference enum's order (tensor.rs `Dtype`), which is increasing alignment.
# fmt: off
ST_DTYPES: dict[str, tuple[int, str | None]] = {
    "BOOL": (8, "|b1"), "F4": (4, None), "F6_E2M3": (6, None), "F6_E3M2": (6, None), "U8": (8, "|u1"), "I8": (8, "|i1"),
    "F8_E5M2": (8, "|u1"), "F8_E4M3": (8, "|u1"), "F8_E8M0": (8, "|u1"),
    "F8_E4M3FNUZ": (8, "|u1"), "F8_E5M2FNUZ": (8, "|u1"),
    "I16": (16, "<i2"), "U16": (16, "<u2"), "F16": (16, "<f2"), "BF16": (16, "<u2"),
    "I32": (32, "<i4"), "U32": (32, "<u4"), "F32": (32, "<f4"),
    "C64": (64, "<c8"), "F64": (64, "<f8"), "I64": (64, "<i8"), "U64": (64, "<u8"),
}
# fmt: on
ALIGN_ORDER: tuple[str, ...] = tuple(ST_DTYPES)
_ALIGN_RANK = {dtype: rank for rank, dtype in enumerate(ALIGN_ORDER)}


class ContainerError(FileError):
    """A safetensors file (or the writer's input) breaks a container rule.

    ``str(e)`` reads ``<file>: tensor '<tensor>': <field>: <message> (expected <expected>, found <found>)``;
    the tensor, field and expected/found parts are left out when empty.
    """


@dataclass(frozen=True)
class _At:
    """Where a check runs: the file and tensor that every error it raises names."""

    file: str
    tensor: str = ""

    def error(self, field: str, message: str, expected: str = "", found: str = "") -> ContainerError:
        return ContainerError(message, file=self.file, tensor=self.tensor, field=field, expected=expected, found=found)


@dataclass(frozen=True)
class TensorEntry:
    """One parsed header entry; ``begin``/``end`` are offsets into the data buffer, ``end`` exclusive."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsFile:
    """A validated file: its header, parsed; tensor bytes are read on demand, one tensor at a time."""

    path: Path
    size: int
    header_len: int
    data_start: int
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]
    identity: Identity | None = None
    """The checked file's identity: every later read reopens the path and proves it is the same file."""

    def _open(self) -> BinaryIO:
        return self.path.open("rb") if self.identity is None else reopen(self.path, self.identity)

    def read(self, name: str) -> bytes:
        """The exact bytes of one tensor (reads only its range), in one piece."""
        return b"".join(self.pieces(name, max(self._entry(name).nbytes, 1)))

    def pieces(self, name: str, size: int = 8 << 20) -> Iterator[bytes]:
        """The bytes of one tensor, ``size`` bytes at a time (the last piece shorter)."""
        entry = self._entry(name)
        with self._open() as f:
            f.seek(self.data_start + entry.begin)
            left = entry.nbytes
            while left:
                data = f.read(min(size, left))
                if not data:
                    at = _At(str(self.path), name)
                    raise at.error(
                        "data_offsets",
                        "file truncated since it was opened",
                        f"{entry.nbytes} bytes",
                        str(entry.nbytes - left),
                    )
                left -= len(data)
                yield data

    def array(self, name: str) -> npt.NDArray[Any]:
        """A read-only memory-mapped view of one tensor (BF16 as raw ``<u2``, F8 as ``|u1``)."""
        entry = self._entry(name)
        np_dtype = ST_DTYPES[entry.dtype][1]
        if np_dtype is None:
            at = _At(str(self.path), name)
            raise at.error("dtype", "sub-byte dtype has no numpy view; use read()", "8 or more bits", entry.dtype)
        if entry.nbytes == 0:  # mmap cannot map zero bytes
            empty = np.zeros(entry.shape, dtype=np_dtype)
            empty.flags.writeable = False
            return empty
        offset = self.data_start + entry.begin
        with self._open() as f:
            return np.memmap(f, dtype=np_dtype, mode="r", offset=offset, shape=entry.shape)

    def _entry(self, name: str) -> TensorEntry:
        entry = self.tensors.get(name)
        if entry is None:
            raise _At(str(self.path), name).error("name", "no such tensor", found=f"{len(self.tensors)} other tensors")
        return entry


def nbytes(dtype: str, shape: Sequence[int], *, limit: int | None = None, file: str = "", tensor: str = "") -> int:
    """Byte size of a tensor, ``numel * bits / 8``, in Python ints (no overflow).

    Raises ContainerError (naming ``file`` and ``tensor``) for an unknown dtype, a sub-byte tensor whose bits
    do not fill whole bytes, or a size above ``limit``; the limit is checked while multiplying, so a shape
    like ``[2**40, 2**40]`` never builds a big number.
    """
    at = _At(file, tensor)
    bits = ST_DTYPES[_check_dtype(dtype, at)][0]
    total_bits = 0 if 0 in shape else bits
    for dim in shape:
        total_bits *= dim
        if limit is not None and total_bits > 8 * limit:
            found = f"{dtype} {_short(list(shape))}"
            raise at.error("shape", "tensor size exceeds the available bytes", f"at most {limit} bytes", found)
    if total_bits % 8:
        expected = f"numel * {bits} bits divisible by 8"
        raise at.error("shape", "sub-byte tensor does not fill whole bytes", expected, f"{total_bits} bits")
    return total_bits // 8


# ---------------------------------------------------------------------------------------------- reader


def open_file(path: Path | str, *, fh: BinaryIO | None = None, max_header: int = MAX_HEADER_BYTES) -> SafetensorsFile:
    """Read and validate the header of a safetensors file; tensor bytes stay on disk until asked for.
    ``fh``: the file already opened under the path policy (``paths.open_in``); later reads prove
    they reopen that same file."""
    path = Path(path)
    at = _At(str(path))
    identity = None
    try:
        with fh if fh is not None else path.open("rb") as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            identity = Identity.of(st) if fh is not None else None
            header_len = _header_len(f.read(8), size, max_header, at)
            raw = f.read(header_len)
    except OSError as e:
        raise at.error("", "cannot read file", found=e.strerror or type(e).__name__) from None
    root = _parse_json(raw, at)
    metadata = _check_metadata(root.pop(METADATA_KEY, None), at)
    buffer_size = size - 8 - header_len
    entries = [_parse_entry(name, value, buffer_size, at.file) for name, value in root.items()]
    ordered = _check_coverage(entries, buffer_size, at.file)
    tensors = {e.name: e for e in ordered}
    return SafetensorsFile(path, size, header_len, 8 + header_len, metadata, tensors, identity)


def _header_len(prefix: bytes, size: int, max_header: int, at: _At) -> int:
    """The prefix N, checked against the limit and the file size before anything is read with it."""
    if size < 8:
        raise at.error("header_len", "header too small", "at least 8 bytes", f"{size} bytes")
    n = int.from_bytes(prefix, "little")
    if n > max_header:
        raise at.error("header_len", "header too large", f"at most {max_header} bytes", f"{n} bytes")
    if 8 + n > size:
        raise at.error("header_len", "header length exceeds the file", f"at most {size - 8} bytes", f"{n} bytes")
    return n


def _parse_json(raw: bytes, at: _At) -> dict[str, object]:
    """UTF-8, starts with ``{``, JSON without NaN/Infinity, no key twice in any object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise at.error("header", "header is not valid UTF-8", found=f"byte {e.start}") from None
    if not text.startswith("{"):
        raise at.error("header", "header must start with '{'", "'{'", _short(text[:1]) if text else "empty header")
    duplicates: list[tuple[dict[str, object], str]] = []

    def to_dict(pairs: list[tuple[str, object]]) -> dict[str, object]:
        obj: dict[str, object] = {}
        for key, value in pairs:
            if key in obj:
                duplicates.append((obj, key))
            obj[key] = value
        return obj

    try:
        root = json.loads(text, object_pairs_hook=to_dict, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise at.error("header", "invalid JSON in header", found=_clip(str(e))) from None
    if not isinstance(root, dict):
        raise at.error("header", "header must be a JSON object", found=_short(root))
    if duplicates:
        obj, key = duplicates[0]
        if obj is root:
            raise _At(at.file, key).error("name", "duplicate tensor name", "unique names", f"{key!r} twice")
        raise at.error(_clip(key), "duplicate key in header JSON", "unique keys", f"{key!r} twice")
    return root  # pyright: ignore[reportUnknownVariableType]


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _parse_entry(name: str, value: object, buffer_size: int, file: str) -> TensorEntry:
    at = _At(file, _check_name(name, _At(file)))
    if not isinstance(value, dict):
        raise at.error("entry", "tensor entry must be an object", "object", _short(value))
    for key in value:
        if key not in ENTRY_KEYS:
            raise at.error(_clip(key), "unknown key in tensor entry", "only " + ", ".join(ENTRY_KEYS), _short(key))
    for key in ENTRY_KEYS:
        if key not in value:
            raise at.error(key, "missing key in tensor entry")
    dtype = _check_dtype(value["dtype"], at)
    shape = _check_shape(value["shape"], at)
    begin, end = _check_offsets(value["data_offsets"], at)
    size = nbytes(dtype, shape, limit=buffer_size, file=file, tensor=name)
    if size != end - begin:
        raise at.error(
            "data_offsets", "data_offsets do not match dtype and shape", f"{size} bytes", f"{end - begin} bytes"
        )
    return TensorEntry(name, dtype, shape, begin, end)


def _check_offsets(offsets: object, at: _At) -> tuple[int, int]:
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_uint(x) for x in offsets):
        raise at.error("data_offsets", "must be two non-negative integers", "[begin, end]", _short(offsets))
    begin: int = offsets[0]
    end: int = offsets[1]
    if begin > end:
        raise at.error("data_offsets", "begin is after end", "begin <= end", _short(offsets))
    return begin, end


def _check_coverage(entries: list[TensorEntry], buffer_size: int, file: str) -> list[TensorEntry]:
    """Sorted by offset, the tensors must tile the data buffer exactly: no hole, no overlap, no tail."""
    ordered = sorted(entries, key=lambda e: (e.begin, e.end, e.name))
    previous = ""
    cursor = 0
    for entry in ordered:
        at, expected, found = _At(file, entry.name), f"begin {cursor}", f"begin {entry.begin}"
        if entry.begin > cursor and not previous:
            raise at.error("data_offsets", "hole before the first tensor", expected, found)
        if entry.begin > cursor:
            raise at.error("data_offsets", f"hole between tensors '{previous}' and '{entry.name}'", expected, found)
        if entry.begin < cursor:
            raise at.error("data_offsets", f"overlaps tensor '{previous}'", expected, found)
        previous, cursor = entry.name, entry.end
    at, expected, found = _At(file, previous), f"{cursor} data bytes", f"{buffer_size} data bytes"
    if cursor < buffer_size:
        raise at.error("size", "trailing bytes after the last tensor", expected, found)
    if cursor > buffer_size:
        raise at.error("size", "file truncated", expected, found)
    return ordered


# ---------------------------------------------------------------------------------------------- shared checks


def _check_name(name: object, at: _At) -> str:
    if not isinstance(name, str) or not name:
        raise at.error("name", "tensor name must be a non-empty string", "non-empty string", _short(name))
    size = len(_utf8(name, at, "name"))
    if size > MAX_NAME_BYTES:
        expected = f"at most {MAX_NAME_BYTES} UTF-8 bytes"
        raise _At(at.file, _clip(name)).error("name", "tensor name too long", expected, f"{size} bytes")
    return name


def _check_dtype(dtype: object, at: _At) -> str:
    if not isinstance(dtype, str) or dtype not in ST_DTYPES:
        raise at.error("dtype", "unknown dtype", "a safetensors dtype such as F32 (case-sensitive)", _short(dtype))
    return dtype


def _check_shape(shape: object, at: _At) -> tuple[int, ...]:
    if not isinstance(shape, list | tuple):
        raise at.error("shape", "shape must be a list of integers", "list", _short(shape))
    if len(shape) > MAX_RANK:
        raise at.error("shape", "rank too large", f"at most {MAX_RANK} dimensions", str(len(shape)))
    dims: list[int] = []
    for dim in shape:
        if not _is_uint(dim):
            raise at.error("shape", "dimension must be a non-negative integer", "integer >= 0", _short(dim))
        dims.append(dim)
    return tuple(dims)


def _check_metadata(metadata: object, at: _At) -> dict[str, str]:
    """``__metadata__``: an object of str -> str; null means empty."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise at.error(METADATA_KEY, "metadata must be an object", "object", _short(metadata))
    checked: dict[str, str] = {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            found = f"{_short(key)}: {_short(value)}"
            raise at.error(METADATA_KEY, "metadata must map strings to strings", "str: str", found)
        _utf8(key, at, METADATA_KEY)
        checked[key] = value
        _utf8(value, at, METADATA_KEY)
    return checked


def _utf8(text: str, at: _At, field: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise at.error(field, "text is not valid Unicode (lone surrogate)", found=_short(text)) from None


def _is_uint(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _clip(text: str, limit: int = 64) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(value: object) -> str:
    return _clip(repr(value))

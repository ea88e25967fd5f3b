"""A strict, bounded GGUF v3 reader for untrusted files.

Layout (little-endian; every offset below counts from the start of the file)::

    header   "GGUF" | u32 version = 3 | u64 tensor_count | u64 kv_count                    (24 bytes)
    kv[i]    string key | u32 value_type | value   (ARRAY = u32 element type | u64 count | elements)
    tinfo[i] string name | u32 n_dims | u64 ne[n_dims] | u32 ggml type | u64 offset
    padding  up to a multiple of ``general.alignment`` (UINT32, default 32): that is ``data_start``
    data     tensor i at ``data_start + offset_i``, packed in tensor-info order, each padded to the alignment
    string = u64 byte length | UTF-8 bytes (no NUL)

``ne[0]`` varies fastest, so the numpy shape is ``ne`` reversed; quantization blocks run along ``ne[0]``.

The reader is at least as strict as llama.cpp's C parser (``gguf_init_from_file``) and stricter than gguf-py:
every count and length is checked against its cap and the bytes left in the file before it sizes a read,
sizes are computed in Python ints, and each tensor must sit exactly where the C loader expects it (the running
sum of the padded sizes before it). Beyond the C parser it refuses invalid UTF-8, bool bytes other than 0/1,
zero-sized or zero-rank tensors, and trailing bytes. Each rejection is a :class:`GGUFError` naming the file,
where (header, key or tensor), the field, and what was expected and found.

Example::

    f = open_gguf("model.gguf")
    f.metadata["general.architecture"]          # (8, 'llama'): (value type id, value)
    f.tensors["blk.0.attn_q.weight"].shape      # (4096, 4096), numpy order
    f.array("blk.0.attn_q.weight")              # read-only memmap; Q8_0 -> uint8 (4096, 4352)
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from qcompiler.backends.gguf.ggml_types import BLOCKS, REMOVED, GGMLType
from qcompiler.errors import QcError
from qcompiler.paths import Identity, reopen

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
HEADER_BYTES = 24
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME is 64 including the terminating NUL
INT64_MAX = 2**63 - 1
MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one ne, type, offset

# GGUF value type id -> (name, numpy dtype of a fixed-size value; "" for STRING and ARRAY).
# fmt: off
VALUE_TYPES: dict[int, tuple[str, str]] = {
    0: ("UINT8", "<u1"), 1: ("INT8", "<i1"), 2: ("UINT16", "<u2"), 3: ("INT16", "<i2"), 4: ("UINT32", "<u4"),
    5: ("INT32", "<i4"), 6: ("FLOAT32", "<f4"), 7: ("BOOL", "<u1"), 8: ("STRING", ""), 9: ("ARRAY", ""),
    10: ("UINT64", "<u8"), 11: ("INT64", "<i8"), 12: ("FLOAT64", "<f8"),
}
# fmt: on
UINT32, BOOL, STRING, ARRAY = 4, 7, 8, 9
# Unquantized ggml types -> numpy dtype of array(); BF16 stays raw <u2. Other types map as uint8 rows.
_NUMPY_DTYPES = {0: "<f4", 1: "<f2", 24: "|i1", 25: "<i2", 26: "<i4", 27: "<i8", 28: "<f8", 30: "<u2"}


class GGUFError(QcError):
    """A GGUF file breaks a format rule: ``<file>: <where>: <field>: <message> (expected X, found Y)``, empty parts
    left out; ``where`` is ``header``, ``metadata``, ``data``, a key or tensor name, or ``kv[i]``/``tensor[i]``."""

    def __init__(
        self, message: str, *, file: str, where: str = "", field: str = "", expected: str = "", found: str = ""
    ) -> None:
        self.message, self.file, self.where, self.field = message, file, where, field
        self.expected, self.found = expected, found
        super().__init__(self.render())

    def render(self) -> str:
        head = "".join(f"{part}: " for part in (self.file, self.where, self.field) if part)
        tail = f" (expected {self.expected}, found {self.found})" if self.expected or self.found else ""
        return head + self.message + tail


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor info: ``shape`` in numpy order (``ne`` reversed); ``offset`` is relative to ``data_start``."""

    name: str
    shape: tuple[int, ...]
    ne: tuple[int, ...]
    type_id: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    """A validated GGUF file. ``metadata`` maps key -> (value type id, value), arrays as lists; the element type
    id of each array is in ``array_types``. Tensor bytes stay on disk until asked for."""

    path: Path
    version: int
    alignment: int
    metadata: dict[str, tuple[int, object]]
    tensors: dict[str, GGUFTensorInfo]
    data_start: int
    size: int
    array_types: dict[str, int] = field(default_factory=dict[str, int])
    identity: Identity | None = None
    """The checked file's identity: every later read reopens the path and proves it is the same file."""

    def _open(self) -> BinaryIO:
        return self.path.open("rb") if self.identity is None else reopen(self.path, self.identity)

    def read(self, name: str) -> bytes:
        """Exactly the bytes of one tensor (one seek and one read)."""
        info = self._info(name)
        with self._open() as f:
            f.seek(self.data_start + info.offset)
            data = f.read(info.nbytes)
        if len(data) != info.nbytes:
            raise _error(
                self.path, name, "size", "file truncated since it was opened", f"{info.nbytes} bytes", len(data)
            )
        return data

    def array(self, name: str) -> npt.NDArray[Any]:
        """A read-only memmap: plain types in their dtype and numpy shape (BF16 as raw ``<u2``); block types as
        ``uint8`` of shape ``shape[:-1] + (bytes per row,)``."""
        info = self._info(name)
        size = self.path.stat().st_size
        if size != self.size:
            raise _error(self.path, name, "size", "file changed size since it was opened", f"{self.size} bytes", size)
        dtype = _NUMPY_DTYPES.get(info.type_id)
        shape = info.shape
        if dtype is None:
            block, type_size = BLOCKS[GGMLType(info.type_id)]
            dtype, shape = "|u1", (*info.shape[:-1], info.ne[0] // block * type_size)
        offset = self.data_start + info.offset
        with self._open() as f:
            return np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=shape)

    def _info(self, name: str) -> GGUFTensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise _error(self.path, _clip(name), "name", "no such tensor", "one of the file's tensors", "none")
        return info


def open_gguf(
    path: Path | str,
    *,
    fh: BinaryIO | None = None,
    max_string: int = 2**30,
    max_array: int = 2**30,
    max_alignment: int = 2**20,
    max_tensors: int = 2**20,
    max_kv: int = 2**20,
) -> GGUFFile:
    """Parse and validate the header, metadata and tensor infos of a GGUF v3 file; raise GGUFError if bad.
    ``fh``: the file already opened under the path policy; later reads prove they reopen it."""
    path = Path(path)
    try:
        with fh if fh is not None else path.open("rb") as f:
            st = os.fstat(f.fileno())
            parser = _Parser(f, str(path), st.st_size, max_string, max_array)
            parsed = parser.parse(path, max_alignment, max_tensors, max_kv)
            return dataclasses.replace(parsed, identity=Identity.of(st)) if fh is not None else parsed
    except OSError as e:
        raise GGUFError("cannot read file", file=str(path), found=e.strerror or type(e).__name__) from None


class _Parser:
    """A cursor over the open file: every read first checks that the file still holds that many bytes."""

    def __init__(self, f: BinaryIO, file: str, size: int, max_string: int, max_array: int) -> None:
        self.f, self.file, self.size, self.pos, self.left = f, file, size, 0, size
        self.max_string, self.max_array = max_string, max_array

    def parse(self, path: Path, max_alignment: int, max_tensors: int, max_kv: int) -> GGUFFile:
        tensor_count, kv_count = self._header(max_tensors, max_kv)
        metadata: dict[str, tuple[int, object]] = {}
        array_types: dict[str, int] = {}
        for i in range(kv_count):
            self._kv(i, metadata, array_types)
        alignment = self._alignment(metadata, max_alignment)
        infos: dict[str, GGUFTensorInfo] = {}
        for i in range(tensor_count):
            info = self._tensor_info(i, infos, alignment)
            infos[info.name] = info
        data_start = self._check_layout(list(infos.values()), alignment)
        return GGUFFile(path, GGUF_VERSION, alignment, metadata, infos, data_start, self.size, array_types)

    def fail(self, where: str, field: str, message: str, expected: str = "", found: object = "") -> GGUFError:
        return _error(self.file, where, field, message, expected, found)

    def take(self, n: int, where: str, field: str) -> bytes:
        if n > self.left:
            raise self.fail(where, field, "unexpected end of file", f"{n} more bytes", f"{self.left} bytes")
        data = self.f.read(n)
        if len(data) != n:
            raise self.fail(where, field, "file shrank while reading", f"{n} bytes", f"{len(data)} bytes")
        self.pos, self.left = self.pos + n, self.left - n
        return data

    def uint(self, nbytes: int, where: str, field: str) -> int:
        return int.from_bytes(self.take(nbytes, where, field), "little")

    def string(self, where: str, field: str, cap: int, cap_field: str = "string length") -> str:
        n = self.uint(8, where, "string length")
        if n > cap:
            raise self.fail(where, cap_field, f"{field} too long", f"at most {cap} bytes", _u64(n))
        if n > self.left:
            expected = f"at most {self.left} bytes"
            raise self.fail(where, "string length", f"{field} runs past the end of the file", expected, n)
        raw = self.take(n, where, field)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            found = f"{raw[e.start : e.start + 4]!r} at byte {e.start}"
            raise self.fail(where, field, "invalid UTF-8", "UTF-8 text", found) from None

    # ------------------------------------------------------------------------------------------ header and metadata

    def _header(self, max_tensors: int, max_kv: int) -> tuple[int, int]:
        if self.size < HEADER_BYTES:
            raise self.fail("header", "size", "file too small for a GGUF header", "≥ 24 bytes", f"{self.size} bytes")
        magic = self.take(4, "header", "magic")
        if magic != GGUF_MAGIC:
            raise self.fail("header", "magic", "not a GGUF file", repr(GGUF_MAGIC), repr(magic))
        version = self.uint(4, "header", "version")
        if version != GGUF_VERSION and version & 0xFFFF == 0 and version:
            raise self.fail("header", "version", "big-endian or byte-swapped file", "3", f"{version:#010x}")
        if version != GGUF_VERSION:
            raise self.fail("header", "version", "unsupported GGUF version", str(GGUF_VERSION), version)
        tensor_count = self.uint(8, "header", "tensor_count")
        kv_count = self.uint(8, "header", "kv_count")
        if tensor_count > max_tensors:
            raise self.fail("header", "tensor_count", "too many tensors", f"at most {max_tensors}", _u64(tensor_count))
        room = self.left // MIN_TENSOR_INFO_BYTES
        if tensor_count > room:
            raise self.fail("header", "tensor_count", "more tensors than the file can hold", f"≤ {room}", tensor_count)
        if kv_count > max_kv:
            raise self.fail("header", "kv_count", "too many key-value pairs", f"at most {max_kv}", _u64(kv_count))
        room = (self.left - tensor_count * MIN_TENSOR_INFO_BYTES) // MIN_KV_BYTES
        if kv_count > room:
            raise self.fail("header", "kv_count", "more key-value pairs than the file can hold", f"≤ {room}", kv_count)
        return tensor_count, kv_count

    def _kv(self, i: int, metadata: dict[str, tuple[int, object]], array_types: dict[str, int]) -> None:
        key = self.string(f"kv[{i}]", "key", self.max_string)
        if not key:
            raise self.fail(f"kv[{i}]", "key", "empty key", "a non-empty key", "''")
        where = _clip(key)
        if key in metadata:
            raise self.fail(where, "key", "duplicate key", "unique keys", f"{where!r} twice")
        vtype = self.uint(4, where, "value_type")
        if vtype not in VALUE_TYPES:
            raise self.fail(where, "value_type", "unknown value type", "0..12", vtype)
        if vtype == ARRAY:
            array_types[key], value = self._array(where)
        else:
            value = self._value(vtype, where)
        metadata[key] = (vtype, value)

    def _value(self, vtype: int, where: str) -> object:
        if vtype == STRING:
            return self.string(where, "string", self.max_string)
        dtype = np.dtype(VALUE_TYPES[vtype][1])
        value = np.frombuffer(self.take(dtype.itemsize, where, "value"), dtype)[0].item()
        if vtype == BOOL and value not in (0, 1):
            raise self.fail(where, "bool", "bool byte must be 0 or 1", "0 or 1", value)
        return bool(value) if vtype == BOOL else value

    def _array(self, where: str) -> tuple[int, list[Any]]:
        etype = self.uint(4, where, "array element type")
        if etype == ARRAY:
            raise self.fail(where, "array element type", "nested arrays are not supported", "a non-array type", "ARRAY")
        if etype not in VALUE_TYPES:
            raise self.fail(where, "array element type", "unknown value type", "0..12 except 9", etype)
        count = self.uint(8, where, "array count")
        if count > self.max_array:
            raise self.fail(where, "array count", "array too long", f"at most {self.max_array}", _u64(count))
        dtype = np.dtype(VALUE_TYPES[etype][1] or "<u8")  # a string needs at least its u64 length
        room = self.left // dtype.itemsize
        if count > room:
            raise self.fail(where, "array count", "array runs past the end of the file", f"at most {room}", count)
        if etype == STRING:
            return etype, [self.string(f"{where}[{j}]", "string", self.max_string) for j in range(count)]
        values = np.frombuffer(self.take(count * dtype.itemsize, where, "array"), dtype)
        if etype != BOOL:
            return etype, values.tolist()
        bad = np.flatnonzero(values > 1)
        if bad.size:
            raise self.fail(f"{where}[{bad[0]}]", "bool", "bool byte must be 0 or 1", "0 or 1", values[bad[0]])
        return etype, [bool(v) for v in values]

    def _alignment(self, metadata: dict[str, tuple[int, object]], max_alignment: int) -> int:
        if ALIGNMENT_KEY not in metadata:
            return DEFAULT_ALIGNMENT
        vtype, value = metadata[ALIGNMENT_KEY]
        if vtype != UINT32 or not isinstance(value, int):
            raise self.fail("metadata", ALIGNMENT_KEY, "wrong value type", "UINT32", VALUE_TYPES[vtype][0])
        if value == 0 or value & (value - 1):
            raise self.fail("metadata", ALIGNMENT_KEY, "alignment must be a power of two", "2**k > 0", value)
        if value > max_alignment:
            raise self.fail("metadata", ALIGNMENT_KEY, "alignment too large", f"at most {max_alignment}", value)
        return value

    # ------------------------------------------------------------------------------------------ tensors

    def _tensor_info(self, i: int, seen: dict[str, GGUFTensorInfo], alignment: int) -> GGUFTensorInfo:
        name = self.string(f"tensor[{i}]", "name", MAX_NAME_BYTES, cap_field="name")
        if not name:
            raise self.fail(f"tensor[{i}]", "name", "empty tensor name", "a non-empty name", "''")
        if name in seen:
            raise self.fail(name, "name", "duplicate tensor name", "unique names", f"{name!r} twice")
        n_dims = self.uint(4, name, "n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.fail(name, "n_dims", "bad number of dimensions", f"1..{MAX_DIMS}", n_dims)
        ne = tuple(self.uint(8, name, "ne") for _ in range(n_dims))
        for d, n in enumerate(ne):
            if not 0 < n <= INT64_MAX:
                raise self.fail(name, "ne", f"ne[{d}] must be positive", f"1..{INT64_MAX}", _u64(n))
        numel = math.prod(ne)
        if numel > INT64_MAX:
            raise self.fail(
                name, "ne", "element count overflows int64", f"≤ {INT64_MAX}", f"{numel} = {' × '.join(map(str, ne))}"
            )
        type_id = self.uint(4, name, "type")
        if type_id in REMOVED or type_id not in BLOCKS:
            what = "removed" if type_id in REMOVED else "unknown"
            expected = f"an id < {max(BLOCKS) + 1}, not 4, 5, 31-33, 36-38"
            raise self.fail(name, "type", f"{what} ggml type", expected, type_id)
        ggml = GGMLType(type_id)
        block, type_size = BLOCKS[ggml]
        if ne[0] % block:
            expected = f"a multiple of {block}"
            raise self.fail(name, "ne", f"ne[0] is not a multiple of the {ggml.name} block size", expected, ne[0])
        nbytes = numel // block * type_size
        if nbytes > INT64_MAX:
            raise self.fail(name, "size", "byte size overflows int64", f"≤ {INT64_MAX}", nbytes)
        if nbytes > self.size:
            raise self.fail(name, "size", "tensor is larger than the whole file", f"≤ {self.size} bytes", nbytes)
        offset = self.uint(8, name, "offset")
        if offset % alignment:
            raise self.fail(name, "offset", "misaligned tensor offset", f"a multiple of {alignment}", _u64(offset))
        return GGUFTensorInfo(name, ne[::-1], ne, type_id, offset, nbytes)

    def _check_layout(self, infos: list[GGUFTensorInfo], alignment: int) -> int:
        """The C rule: tensor i sits at the sum of the padded sizes before it; the file ends after the last pad."""
        for prev, info in pairwise(infos):
            if info.offset < prev.offset:
                found = f"{info.offset} < {prev.offset}"
                raise self.fail(info.name, "offset", f"out of order: stored before '{prev.name}'", "increasing", found)
        expected, prev_name = 0, ""
        for info in infos:
            if info.offset < expected:
                raise self.fail(info.name, "offset", f"overlaps tensor '{prev_name}'", str(expected), info.offset)
            if info.offset > expected:
                after = f"after tensor '{prev_name}'" if prev_name else "before the first tensor"
                raise self.fail(info.name, "offset", f"gap {after}", str(expected), _u64(info.offset))
            expected, prev_name = expected + _align_up(info.nbytes, alignment), info.name
        data_start = _align_up(self.pos, alignment)
        if not infos and self.size == self.pos:  # the C parser needs no padding without tensors; gguf-py writes it
            return data_start
        for info in infos:
            end = data_start + info.offset + info.nbytes
            if end > self.size:
                raise self.fail(info.name, "size", "tensor data runs past the end of the file", f"≤ {self.size}", end)
        padded_end, last = data_start + expected, infos[-1].name if infos else "data"
        if padded_end > self.size:
            raise self.fail(last, "size", "file ends inside the padding", f"{padded_end} bytes", f"{self.size} bytes")
        if padded_end < self.size:
            raise self.fail(
                "data", "size", "trailing bytes after the data", f"{padded_end} bytes", f"{self.size} bytes"
            )
        return data_start


def _error(file: object, where: str, field: str, message: str, expected: str = "", found: object = "") -> GGUFError:
    return GGUFError(message, file=str(file), where=where, field=field, expected=expected, found=str(found))


def _align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _u64(n: int) -> str:
    """A u64 as read, plus its int64 reading when the C parser would see it as negative."""
    return f"{n} (= {n - 2**64} as int64)" if n > INT64_MAX else str(n)


def _clip(text: str, limit: int = 64) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."

"""GGUF v3 writer: typed metadata, tensor infos, aligned data, in the exact order llama.cpp's C parser
requires.

Layout (little-endian)::

    "GGUF" | u32 version=3 | u64 n_tensors | u64 n_kv
    n_kv x (string key | u32 value type | value)
    n_tensors x (string name | u32 n_dims | u64 ne[n_dims] (fastest dim first) | u32 ggml type | u64 offset)
    zero padding to the alignment (from the start of the file)
    tensor data, each tensor at its offset, each followed by zero padding to the alignment (the last too)

A string is ``u64 length + UTF-8 bytes``. An array is ``u32 element type | u64 count | elements``;
arrays of arrays are never written (the C parser refuses them). Every metadata value carries its
type explicitly (``KV.u32("llama.context_length", 64)``): llama.cpp checks scalar types exactly,
so a u64 where it reads a u32 fails to load. Tensors are placed in the order given, each at the
running sum of its aligned predecessors: the only placement the C parser accepts.

    >>> kvs = [KV.string("general.architecture", "llama"), KV.u32("general.alignment", 32)]
    >>> t = TensorPayload("output_norm.weight", (4,), 0, b"\\x00" * 16)
    >>> data = b"".join(serialize(kvs, [t]))
    >>> data[:4], len(data) % 32
    (b'GGUF', 0)
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum

from qcompiler.errors import QcError

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32
MAX_NAME_BYTES = 63
"""Tensor names must be shorter than ggml's 64-byte name field."""


class GGUFValueType(IntEnum):
    """Metadata value types, with the spec's ids."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
"""struct format of every fixed-size value type."""


class GGUFWriteError(QcError):
    """A value or tensor cannot be written as asked (wrong type, out of range, bad name)."""


@dataclass(frozen=True)
class KV:
    """One metadata entry with its explicit type (``elem`` is the element type of an array)."""

    key: str
    type: GGUFValueType
    value: object
    elem: GGUFValueType | None = None

    @staticmethod
    def u32(key: str, value: int) -> KV:
        return KV(key, GGUFValueType.UINT32, value)

    @staticmethod
    def i32(key: str, value: int) -> KV:
        return KV(key, GGUFValueType.INT32, value)

    @staticmethod
    def f32(key: str, value: float) -> KV:
        return KV(key, GGUFValueType.FLOAT32, value)

    @staticmethod
    def boolean(key: str, value: bool) -> KV:
        return KV(key, GGUFValueType.BOOL, value)

    @staticmethod
    def string(key: str, value: str) -> KV:
        return KV(key, GGUFValueType.STRING, value)

    @staticmethod
    def array(key: str, elem: GGUFValueType, values: Sequence[object]) -> KV:
        return KV(key, GGUFValueType.ARRAY, list(values), elem)


@dataclass(frozen=True)
class TensorPayload:
    """One tensor: name, numpy-order shape, ggml type id, and exactly its bytes."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    data: bytes | memoryview | Callable[[], bytes | memoryview]
    size: int = -1
    """With ``data`` a function (called when the tensor's turn to be written comes, so a streamed
    write holds one tensor's bytes at a time): the bytes it must return."""

    @property
    def nbytes(self) -> int:
        return self.size if callable(self.data) else memoryview(self.data).nbytes

    def payload(self) -> bytes | memoryview:
        data = self.data() if callable(self.data) else self.data
        if memoryview(data).nbytes != self.nbytes:
            raise GGUFWriteError(
                f"tensor {self.name!r}: {memoryview(data).nbytes} bytes made, {self.nbytes} declared in the header"
            )
        return data


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def encode_string(text: str, where: str) -> bytes:
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:
        raise GGUFWriteError(f"{where}: not encodable as UTF-8: {text!r}") from None
    return struct.pack("<Q", len(raw)) + raw


def encode_scalar(t: GGUFValueType, value: object, where: str) -> bytes:
    if t == GGUFValueType.STRING:
        if not isinstance(value, str):
            raise GGUFWriteError(f"{where}: expected a string, found {type(value).__name__}")
        return encode_string(value, where)
    fmt = SCALARS.get(t)
    if fmt is None:
        raise GGUFWriteError(f"{where}: {t.name} is not a scalar type")
    if t == GGUFValueType.BOOL and not isinstance(value, bool):
        raise GGUFWriteError(f"{where}: expected a bool, found {value!r}")
    try:
        return struct.pack(fmt, value)
    except struct.error as e:
        raise GGUFWriteError(f"{where}: {value!r} does not fit {t.name}: {e}") from None


def encode_kv(kv: KV) -> bytes:
    where = f"metadata {kv.key!r}"
    if not kv.key:
        raise GGUFWriteError("metadata key must not be empty")
    out = encode_string(kv.key, where) + struct.pack("<I", kv.type)
    if kv.type != GGUFValueType.ARRAY:
        return out + encode_scalar(kv.type, kv.value, where)
    if kv.elem is None or kv.elem == GGUFValueType.ARRAY or not isinstance(kv.value, list):
        raise GGUFWriteError(f"{where}: an array needs a non-array element type and a list of values")
    values: list[object] = kv.value  # pyright: ignore[reportUnknownVariableType]
    parts = [struct.pack("<IQ", kv.elem, len(values))]
    parts += [encode_scalar(kv.elem, v, f"{where}[{i}]") for i, v in enumerate(values)]
    return out + b"".join(parts)


def tensor_info(t: TensorPayload, offset: int) -> bytes:
    raw = t.name.encode("utf-8")
    if not raw or len(raw) > MAX_NAME_BYTES:
        raise GGUFWriteError(f"tensor name {t.name!r} must be 1..{MAX_NAME_BYTES} bytes")
    if not 1 <= len(t.shape) <= 4 or any(d <= 0 for d in t.shape):
        raise GGUFWriteError(f"tensor {t.name!r}: shape {list(t.shape)} must have 1-4 positive dims")
    ne = tuple(reversed(t.shape))
    return struct.pack("<Q", len(raw)) + raw + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, t.type_id, offset)


def layout(
    kvs: Sequence[KV], tensors: Sequence[TensorPayload], alignment: int = DEFAULT_ALIGNMENT
) -> tuple[bytes, list[int]]:
    """The padded header (everything before the data) and each tensor's offset from the data start."""
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFWriteError(f"alignment must be a positive power of two, found {alignment}")
    keys = [kv.key for kv in kvs]
    if len(set(keys)) != len(keys):
        raise GGUFWriteError(f"duplicate metadata key {next(k for k in keys if keys.count(k) > 1)!r}")
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise GGUFWriteError(f"duplicate tensor name {next(n for n in names if names.count(n) > 1)!r}")
    offsets, offset = [], 0
    for t in tensors:
        offsets.append(offset)
        offset += align_up(t.nbytes, alignment)
    head = GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(kvs))
    head += b"".join(encode_kv(kv) for kv in kvs)
    head += b"".join(tensor_info(t, o) for t, o in zip(tensors, offsets, strict=True))
    return head + b"\0" * (align_up(len(head), alignment) - len(head)), offsets


def serialize(
    kvs: Sequence[KV], tensors: Sequence[TensorPayload], alignment: int = DEFAULT_ALIGNMENT
) -> Iterator[bytes | memoryview]:
    """Yield the header, then each tensor's bytes and its padding (streaming; nothing is joined)."""
    head, _ = layout(kvs, tensors, alignment)
    yield head
    for t in tensors:
        view = memoryview(t.payload()).cast("B")
        pad = align_up(view.nbytes, alignment) - view.nbytes
        yield view
        del view  # before the next tensor's bytes are made
        if pad:
            yield b"\0" * pad

"""Safe ONNX external data: write it (``externalize``) and check it before onnxruntime reads it.

An ONNX ``TensorProto`` with external data has ``data_location = EXTERNAL`` and ``external_data`` key/values:
``location`` (a relative path), ``offset`` and ``length`` (decimal strings). onnxruntime refuses unknown keys, and
``onnx.checker`` compares neither ``offset + length`` with the file size nor ``length`` with the tensor's byte size,
so ``check_external_data`` does, and more. The rules, each refused with an ``ArtifactError`` naming the tensor:

- keys: only ``location``, ``offset``, ``length`` (``checksum`` is refused: we never emit it), each at most once,
  ``location`` required; a tensor with ``external_data`` entries must have ``data_location = EXTERNAL`` and the
  reverse, and it must carry no inline data (``raw_data`` or a typed ``*_data`` field);
- ``location``: non-empty, no NUL, no backslash, not absolute, no drive letter; once resolved with
  ``os.path.realpath`` it lies inside the resolved model directory; it has no ``..`` component (even one that
  resolves inside) and no empty or ``.`` component (``a//b``, ``./b``, ``b/``);
- the file: no component of the path below the model directory is a symbolic link; the file itself is a regular
  file (``lstat``, not a symlink) with exactly one hard link;
- ``offset`` / ``length``: canonical decimal strings of non-negative integers, at most ``MAX_INT`` (``2**63 - 1``):
  ``0`` or a digit 1-9 followed by digits. Signs, spaces, hex and *leading zeros* (``"007"``) are refused: onnx and
  ``externalize`` write ``str(int)``, so any other spelling was not written by a known writer. ``offset`` defaults
  to 0 and ``length`` to the tensor's byte size;
- ``length == tensor_nbytes(tensor)`` and ``offset + length <= file size`` (python ints, no overflow).

Byte sizes (``tensor_nbytes``): ``ceil(numel * bits / 8)`` with the bit width from ``_BITS``; 4-bit (INT4, UINT4,
FLOAT4E2M1) and 2-bit (INT2, UINT2) types are packed, so an odd INT4 count takes ``ceil(n / 2)`` bytes. ``numel`` is
the product of ``dims`` (no dims: a scalar, 1). Types without a fixed packed size (STRING, 6-bit floats) are refused.

``externalize`` writes: every graph initializer of at least ``threshold`` bytes goes into one blob, each at an
offset that is a multiple of ``PAGE`` (zero padding between), with exactly the keys above. ``placements`` is that
layout one tensor at a time (the binding gate compares the data file against it without building the blob).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import onnx
from onnx import numpy_helper

PAGE = 4096
ALLOWED_KEYS = ("location", "offset", "length")
MAX_INT = 2**63 - 1

DECIMAL = re.compile(r"0|[1-9][0-9]*")
DRIVE = re.compile(r"[A-Za-z]:")
TYPED_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")

# Bits per element, by TensorProto.DataType name (names an older onnx lacks are skipped).
_BITS_BY_NAME = {
    "FLOAT": 32,
    "UINT8": 8,
    "INT8": 8,
    "UINT16": 16,
    "INT16": 16,
    "INT32": 32,
    "INT64": 64,
    "BOOL": 8,
    "FLOAT16": 16,
    "DOUBLE": 64,
    "UINT32": 32,
    "UINT64": 64,
    "COMPLEX64": 64,
    "COMPLEX128": 128,
    "BFLOAT16": 16,
    "FLOAT8E4M3FN": 8,
    "FLOAT8E4M3FNUZ": 8,
    "FLOAT8E5M2": 8,
    "FLOAT8E5M2FNUZ": 8,
    "FLOAT8E8M0": 8,
    "UINT4": 4,
    "INT4": 4,
    "FLOAT4E2M1": 4,
    "UINT2": 2,
    "INT2": 2,
}
_BITS: dict[int, int] = {
    int(getattr(onnx.TensorProto, name)): bits
    for name, bits in _BITS_BY_NAME.items()
    if hasattr(onnx.TensorProto, name)
}


@dataclass(frozen=True)
class ExternalRef:
    """One checked external-data reference: ``length`` bytes of ``location`` from ``offset`` hold ``tensor``."""

    tensor: str
    location: str
    offset: int
    length: int


def tensor_nbytes(t: onnx.TensorProto) -> int:
    """The exact byte size of ``t``'s data from its ``dims`` and ``data_type``; ValueError if it has none."""
    bits = _BITS.get(t.data_type)
    if bits is None:
        raise ValueError(f"tensor {t.name!r}: data_type {t.data_type} has no fixed byte size")
    numel = 1
    for d in t.dims:
        if d < 0:
            raise ValueError(f"tensor {t.name!r}: negative dim {d}")
        numel *= int(d)
    return (numel * bits + 7) // 8


# ---------------------------------------------------------------------------------------------------------- writing


def _check_plain_name(location: str) -> None:
    if (
        not location
        or "/" in location
        or "\\" in location
        or "\0" in location
        or location in (".", "..")
        or os.path.isabs(location)
        or DRIVE.match(location)
    ):
        raise ValueError(f"external data location must be a plain relative file name, got {location!r}")


def _raw_bytes(t: onnx.TensorProto, size: int) -> bytes:
    raw = t.raw_data if t.HasField("raw_data") else numpy_helper.from_array(numpy_helper.to_array(t)).raw_data
    if len(raw) != size:
        raise ValueError(f"initializer {t.name!r}: holds {len(raw)} bytes, its dims and type need {size}")
    return raw


def _set_external(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    for name in ("raw_data", *TYPED_FIELDS):
        t.ClearField(name)
    del t.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    t.data_location = onnx.TensorProto.EXTERNAL


def placements(
    model: onnx.ModelProto, location: str, threshold: int = 1024
) -> Iterator[tuple[onnx.TensorProto, int, bytes]]:
    """Lay ``model``'s large initializers out in one blob, one at a time: yields ``(tensor, offset, bytes)``
    in blob order, then points the tensor at that range (its inline data cleared), so a consumer that
    writes or compares each piece never holds the whole blob. The layout ``externalize`` writes."""
    _check_plain_name(location)
    end = 0
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL or len(t.external_data) > 0:
            raise ValueError(f"initializer {t.name!r} already uses external data")
        if t.data_type not in _BITS:
            continue
        size = tensor_nbytes(t)
        if size < threshold:
            continue
        raw = _raw_bytes(t, size)
        offset = -(-end // PAGE) * PAGE
        yield t, offset, raw
        _set_external(t, location, offset, size)
        end = offset + size


Place = Callable[[onnx.TensorProto, int, int, bytes], None]
"""``(tensor, end of the blob so far, its page-aligned offset, its bytes)``: write (or check) one piece."""


class StreamedInitializers(list[onnx.TensorProto]):
    """A graph's initializer list that externalizes each large one as it is appended: the layout
    ``externalize`` writes (page-aligned, in append order, same keys), each piece handed to ``place``
    (which writes it, or compares it with a file) so the blob is never held; the tensor keeps only
    its reference. With ``shared`` instead (the no-cache graph's list), each large initializer
    must be one the ``shared`` list placed under the same name with the same bytes (sha256), and
    points at those bytes."""

    def __init__(
        self,
        location: str,
        place: Place | None = None,
        shared: StreamedInitializers | None = None,
        threshold: int = 1024,
    ) -> None:
        super().__init__()
        _check_plain_name(location)
        self.location, self.place, self.shared, self.threshold = location, place, shared, threshold
        self.end = 0
        self.placed: dict[str, tuple[int, int, str]] = {}
        """Initializer name -> (offset, length, sha256) in the blob."""

    def append(self, t: onnx.TensorProto) -> None:
        size = tensor_nbytes(t) if t.data_type in _BITS else -1
        if size >= self.threshold:
            raw = _raw_bytes(t, size)
            digest = hashlib.sha256(raw).hexdigest()
            if self.shared is not None:
                offset, length, want = self.shared.placed.get(t.name, (0, -1, ""))
                if (length, want) != (size, digest):
                    raise ValueError(f"{t.name}: the no-cache graph's initializer is not stored by model.onnx")
            else:
                assert self.place is not None
                offset = -(-self.end // PAGE) * PAGE
                self.place(t, self.end, offset, raw)
                self.end = offset + size
                self.placed[t.name] = (offset, size, digest)
            del raw
            _set_external(t, self.location, offset, size)
            lean = onnx.TensorProto()  # protobuf keeps a cleared field's bytes in the message's arena:
            lean.CopyFrom(t)  # only a fresh message without them lets the bytes go
            t = lean
        super().append(t)


def externalize(model: onnx.ModelProto, location: str, threshold: int = 1024) -> bytes:
    """Move every graph initializer of at least ``threshold`` bytes into one blob and return the blob.

    Each tensor starts at a multiple of ``PAGE`` (zero padding between) and gets exactly the keys
    ``location``/``offset``/``length``; its inline data is cleared. Typed-field initializers are converted to raw
    bytes with ``onnx.numpy_helper``; STRING initializers (no fixed byte layout) stay inline. ``location`` must be a
    plain relative file name, else ValueError. Mutates ``model`` in place.
    """
    blob = bytearray()
    for _, offset, raw in placements(model, location, threshold):
        blob += bytes(offset - len(blob))
        blob += raw
    return bytes(blob)


# ---------------------------------------------------------------------------------------------------------- reading

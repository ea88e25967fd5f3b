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
offset that is a multiple of ``PAGE`` (zero padding between), with exactly the keys above.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import onnx
from onnx import numpy_helper

from qcompiler.artifact.reader import ArtifactError

PAGE = 4096
ALLOWED_KEYS = ("location", "offset", "length")
MAX_INT = 2**63 - 1

_DECIMAL = re.compile(r"0|[1-9][0-9]*")
_DRIVE = re.compile(r"[A-Za-z]:")
_TYPED_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")

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
        or _DRIVE.match(location)
    ):
        raise ValueError(f"external data location must be a plain relative file name, got {location!r}")


def _raw_bytes(t: onnx.TensorProto, size: int) -> bytes:
    raw = t.raw_data if t.HasField("raw_data") else numpy_helper.from_array(numpy_helper.to_array(t)).raw_data
    if len(raw) != size:
        raise ValueError(f"initializer {t.name!r}: holds {len(raw)} bytes, its dims and type need {size}")
    return raw


def _set_external(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    for name in ("raw_data", *_TYPED_FIELDS):
        t.ClearField(name)
    del t.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    t.data_location = onnx.TensorProto.EXTERNAL


def externalize(model: onnx.ModelProto, location: str, threshold: int = 1024) -> bytes:
    """Move every graph initializer of at least ``threshold`` bytes into one blob and return the blob.

    Each tensor starts at a multiple of ``PAGE`` (zero padding between) and gets exactly the keys
    ``location``/``offset``/``length``; its inline data is cleared. Typed-field initializers are converted to raw
    bytes with ``onnx.numpy_helper``; STRING initializers (no fixed byte layout) stay inline. ``location`` must be a
    plain relative file name, else ValueError. Mutates ``model`` in place.
    """
    _check_plain_name(location)
    blob = bytearray()
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL or len(t.external_data) > 0:
            raise ValueError(f"initializer {t.name!r} already uses external data")
        if t.data_type not in _BITS:
            continue
        size = tensor_nbytes(t)
        if size < threshold:
            continue
        raw = _raw_bytes(t, size)
        offset = -(-len(blob) // PAGE) * PAGE
        blob += bytes(offset - len(blob))
        blob += raw
        _set_external(t, location, offset, size)
    return bytes(blob)


# ---------------------------------------------------------------------------------------------------------- reading


def _graph_tensors(g: onnx.GraphProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    yield from ((t.name, t) for t in g.initializer)
    for s in g.sparse_initializer:
        yield f"{s.values.name}.values", s.values
        yield f"{s.values.name}.indices", s.indices
    for node in g.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    where = node.name or node.op_type
    for a in node.attribute:
        if a.HasField("t"):
            yield a.t.name or f"{where}.{a.name}", a.t
        for i, t in enumerate(a.tensors):
            yield t.name or f"{where}.{a.name}[{i}]", t
        sparse = [a.sparse_tensor] if a.HasField("sparse_tensor") else []
        for s in [*sparse, *a.sparse_tensors]:
            name = s.values.name or f"{where}.{a.name}"
            yield f"{name}.values", s.values
            yield f"{name}.indices", s.indices
        if a.HasField("g"):
            yield from _graph_tensors(a.g)
        for sub in a.graphs:
            yield from _graph_tensors(sub)


def _model_tensors(model: onnx.ModelProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    yield from _graph_tensors(model.graph)
    for f in model.functions:
        for node in f.node:
            yield from _node_tensors(node)
    for info in model.training_info:
        yield from _graph_tensors(info.initialization)
        yield from _graph_tensors(info.algorithm)


def _entries(t: onnx.TensorProto, name: str, model_file: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in t.external_data:
        field = f"external_data.{e.key}" if e.key in ALLOWED_KEYS or e.key == "checksum" else "external_data"
        if e.key == "checksum":
            raise ArtifactError(
                "checksum key is refused (qcompiler never emits it)",
                file=model_file,
                tensor=name,
                field=field,
                expected=f"only {', '.join(ALLOWED_KEYS)}",
                found="checksum",
            )
        if e.key not in ALLOWED_KEYS:
            raise ArtifactError(
                "unknown external_data key",
                file=model_file,
                tensor=name,
                field=field,
                expected=f"one of {', '.join(ALLOWED_KEYS)}",
                found=repr(e.key),
            )
        if e.key in out:
            raise ArtifactError(
                "duplicate external_data key",
                file=model_file,
                tensor=name,
                field=field,
                expected="each key at most once",
                found=f"{e.key!r} twice",
            )
        out[e.key] = e.value
    if "location" not in out:
        raise ArtifactError(
            "location is missing",
            file=model_file,
            tensor=name,
            field="external_data.location",
            expected="a relative file name",
            found="no location key",
        )
    return out


def _check_location(location: str, root: Path, name: str, model_file: str) -> None:
    field = "external_data.location"

    def fail(message: str) -> ArtifactError:
        return ArtifactError(
            message,
            file=model_file,
            tensor=name,
            field=field,
            expected="a relative path inside the artifact directory",
            found=repr(location),
        )

    if not location:
        raise fail("location is empty")
    if "\0" in location:
        raise fail("location contains a NUL byte")
    if "\\" in location:
        raise fail("location contains a backslash")
    if location.startswith("/") or os.path.isabs(location):
        raise fail("location is an absolute path")
    if _DRIVE.match(location):
        raise fail("location starts with a drive letter")
    real_root = os.path.realpath(root)
    resolved = os.path.realpath(root / location)
    if os.path.commonpath([real_root, resolved]) != real_root:
        raise fail("location escapes the artifact directory")
    if ".." in location.split("/"):
        raise fail("location has a '..' component")
    if any(part in ("", ".") for part in location.split("/")):
        raise fail("location has an empty or '.' component")


def _check_file(location: str, root: Path, name: str) -> int:
    """lstat every component below ``root``; return the data file's size."""
    field = "external_data.location"
    path = root
    parts = PurePosixPath(location).parts
    for i, part in enumerate(parts):
        path = path / part
        try:
            st = os.lstat(path)
        except OSError:
            raise ArtifactError("data file is missing", file=location, tensor=name, field=field) from None
        if stat.S_ISLNK(st.st_mode):
            what = "is a symbolic link" if i == len(parts) - 1 else "passes through a symbolic link directory"
            raise ArtifactError(what, file=location, tensor=name, field=field, found=f"{part!r} is a link")
        if i < len(parts) - 1 and not stat.S_ISDIR(st.st_mode):
            raise ArtifactError(
                "a parent of the data file is not a directory",
                file=location,
                tensor=name,
                field=field,
                found=repr(part),
            )
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ArtifactError(
            "is not a regular file",
            file=location,
            tensor=name,
            field=field,
            expected="a regular file",
            found=stat.filemode(st.st_mode),
        )
    if st.st_nlink > 1:
        raise ArtifactError(
            f"has {st.st_nlink} hard links",
            file=location,
            tensor=name,
            field=field,
            expected="1 link",
            found=st.st_nlink,
        )
    return st.st_size


def _parse_int(value: str | None, default: int, key: str, name: str, model_file: str) -> int:
    if value is None:
        return default
    if not _DECIMAL.fullmatch(value):
        raise ArtifactError(
            f"{key} is not a canonical non-negative decimal integer",
            file=model_file,
            tensor=name,
            field=f"external_data.{key}",
            expected="0 or [1-9][0-9]*",
            found=repr(value),
        )
    if len(value) > len(str(MAX_INT)) or int(value) > MAX_INT:
        raise ArtifactError(
            f"{key} is out of range",
            file=model_file,
            tensor=name,
            field=f"external_data.{key}",
            expected=f"<= {MAX_INT}",
            found=value[:40],
        )
    return int(value)


def _no_inline_data(t: onnx.TensorProto, name: str, model_file: str) -> None:
    inline = ["raw_data"] if t.HasField("raw_data") else []
    inline += [f for f in _TYPED_FIELDS if len(getattr(t, f)) > 0]
    if inline:
        raise ArtifactError(
            "tensor carries inline data as well as external data",
            file=model_file,
            tensor=name,
            field=inline[0],
            expected="no inline data",
            found=", ".join(inline),
        )


def _nbytes(t: onnx.TensorProto, name: str, model_file: str) -> int:
    try:
        return tensor_nbytes(t)
    except ValueError as e:
        raise ArtifactError(
            f"tensor has no computable byte size: {e}", file=model_file, tensor=name, field="dims/data_type"
        ) from None


def _check_tensor(t: onnx.TensorProto, name: str, root: Path, model_file: str) -> ExternalRef:
    if t.data_location != onnx.TensorProto.EXTERNAL:
        raise ArtifactError(
            "external_data entries on a tensor whose data_location is not EXTERNAL",
            file=model_file,
            tensor=name,
            field="data_location",
            expected="EXTERNAL",
            found=t.data_location,
        )
    entries = _entries(t, name, model_file)
    location = entries["location"]
    _no_inline_data(t, name, model_file)
    _check_location(location, root, name, model_file)
    size = _check_file(location, root, name)
    nbytes = _nbytes(t, name, model_file)
    offset = _parse_int(entries.get("offset"), 0, "offset", name, model_file)
    length = _parse_int(entries.get("length"), nbytes, "length", name, model_file)
    if length != nbytes:
        raise ArtifactError(
            "length does not match the tensor's dims and type",
            file=model_file,
            tensor=name,
            field="external_data.length",
            expected=nbytes,
            found=length,
        )
    if offset + length > size:
        raise ArtifactError(
            "offset + length past the end of the file",
            file=location,
            tensor=name,
            field="external_data.offset",
            expected=f"<= {size} bytes",
            found=offset + length,
        )
    return ExternalRef(tensor=name, location=location, offset=offset, length=length)


def check_external_data(model: onnx.ModelProto, model_dir: Path, model_file: str) -> list[ExternalRef]:
    """Check every external-data reference of ``model`` (saved as ``model_dir / model_file``) by the module's rules.

    Walks graph initializers, sparse initializers, node-attribute tensors, subgraphs, functions and training info.
    Raises ``ArtifactError`` on the first problem; returns the references in model order.
    """
    refs: list[ExternalRef] = []
    for name, t in _model_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL or len(t.external_data) > 0:
            refs.append(_check_tensor(t, name, model_dir, model_file))
    return refs

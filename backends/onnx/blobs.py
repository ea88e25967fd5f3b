"""Blob locations inside an ONNX artifact, used by its ``graph.qir``: ``onnx:FILE#INITIALIZER[@VIEW,...]``.

The model is parsed once and its external data checked (``external.check_external_data``) before any
byte is read; then the initializer's bytes (``raw_data`` or its external range) go through the views,
left to right:

| view | does |
|---|---|
| ``nibbles`` | int4/uint4 packed two per byte (low nibble first) -> one value per byte, in the initializer's shape |
| ``T`` | transpose a 2-D array |
| ``every=R`` | keep every ``R``-th column (a qparam repeated over ``R`` blocks) |
| ``fields=B:C`` | unpack ``B``-bit unsigned fields along each row, keep ``C`` columns |
| ``sub=O`` | subtract ``O`` and store as int8 (MatMulNBits' offset zero points) |

``read_blob`` then checks length and sha256 against the declaration.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto

from qcompiler.backends.onnx.builder import ONNX_DTYPES
from qcompiler.backends.onnx.external import ExternalRef, tensor_nbytes
from qcompiler.backends.onnx.external_check import check_external_data
from qcompiler.backends.onnx.layouts import unpack_fields
from qcompiler.errors import BlobError
from qcompiler.ir.blobs import open_blob_file, open_cached, reader
from qcompiler.ir.core import BlobRef

MAX_MODEL_BYTES = 2**31 - 1
"""A serialized ModelProto is below 2 GiB (protobuf); a larger file is refused before it is parsed."""
FOUR_BIT = (TensorProto.INT4, TensorProto.UINT4)
NUMPY: dict[int, np.dtype[np.generic]] = {
    TensorProto.FLOAT: np.dtype("<f4"),
    TensorProto.DOUBLE: np.dtype("<f8"),
    TensorProto.FLOAT16: np.dtype("<f2"),
    TensorProto.BFLOAT16: np.dtype("<u2"),
    TensorProto.INT8: np.dtype("i1"),
    TensorProto.UINT8: np.dtype("u1"),
    TensorProto.INT16: np.dtype("<i2"),
    TensorProto.UINT16: np.dtype("<u2"),
    TensorProto.INT32: np.dtype("<i4"),
    TensorProto.UINT32: np.dtype("<u4"),
    TensorProto.INT64: np.dtype("<i8"),
    TensorProto.UINT64: np.dtype("<u8"),
    TensorProto.BOOL: np.dtype("u1"),
}
"""The numpy layout ``graph.qir`` reads each ONNX data type's bytes with (bf16 as raw 16-bit words)."""
_BYTE = np.arange(256)
_PAIRS = np.stack([_BYTE & 0xF, _BYTE >> 4], axis=1)
NIBBLES: dict[int, np.ndarray] = {
    TensorProto.INT4: np.where(_PAIRS > 7, _PAIRS - 16, _PAIRS).astype(np.int8),
    TensorProto.UINT4: _PAIRS.astype(np.uint8),
}
"""Byte -> its two 4-bit values (low nibble first), for ``nibbles``: one gather per initializer."""


@dataclass(frozen=True)
class OnnxFile:
    """A parsed model whose external data passed every check."""

    path: Path
    model: onnx.ModelProto
    initializers: dict[str, onnx.TensorProto]
    external: dict[str, ExternalRef]


def load_model(path: Path, fh: BinaryIO | None = None) -> onnx.ModelProto:
    """Parse a model file (``fh``: already opened under the path policy), refused over 2 GiB first."""
    if fh is None:
        fh, _ = open_blob_file(path.parent, path.name, "onnx")
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if size > MAX_MODEL_BYTES:
            raise BlobError(f"{path.name}: larger than a protobuf can be ({size} bytes)")
        data = fh.read()
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as e:  # protobuf raises DecodeError (and others) on malformed input
        raise BlobError(f"{path.name}: not a valid ONNX model ({type(e).__name__})") from None
    return model


def open_onnx(path: Path, fh: BinaryIO | None = None) -> OnnxFile:
    model = load_model(path, fh)
    refs = check_external_data(model, path.parent, path.name)
    return OnnxFile(path, model, {t.name: t for t in model.graph.initializer}, {r.tensor: r for r in refs})


def initializer_bytes(f: OnnxFile, name: str) -> bytes:
    t = f.initializers.get(name)
    if t is None:
        raise BlobError(f"{f.path.name}: no initializer {name!r}")
    ref = f.external.get(name)
    if ref is None:
        if t.HasField("raw_data"):
            return bytes(t.raw_data)
        try:
            return onnx.numpy_helper.to_array(t).tobytes()
        except Exception as e:  # onnx raises ValueError, TypeError ... on typed fields that disagree with dims
            raise BlobError(
                f"{f.path.name}: initializer {name!r}: typed data unreadable ({type(e).__name__})"
            ) from None
    fh, _ = open_blob_file(f.path.parent, ref.location, "onnx external data")
    with fh:
        fh.seek(ref.offset)
        data = fh.read(ref.length)
    if len(data) != ref.length:
        raise BlobError(f"{ref.location}: truncated under tensor {name!r}")
    return data


def as_array(f: OnnxFile, name: str, data: bytes) -> np.ndarray:
    """``data`` as the initializer's array (4-bit types: the packed bytes, one row), once its length is
    exactly what ``data_type`` and ``dims`` need and the type has a fixed numpy layout (``NUMPY``)."""
    t = f.initializers[name]
    where = f"{f.path.name}: initializer {name!r}"
    try:
        nbytes = tensor_nbytes(t)
    except ValueError as e:
        raise BlobError(f"{where}: {e}") from None
    if len(data) != nbytes:
        raise BlobError(f"{where}: data_type {t.data_type} x dims {list(t.dims)} is {nbytes} bytes, found {len(data)}")
    if t.data_type in FOUR_BIT:
        return np.frombuffer(data, np.uint8)
    dtype = NUMPY.get(t.data_type)
    if dtype is None:
        raise BlobError(f"{where}: data_type {t.data_type} has no numpy layout here (known: {sorted(NUMPY)})")
    return np.frombuffer(data, dtype).reshape(tuple(int(d) for d in t.dims))


def unpack_nibbles(f: OnnxFile, name: str, raw: np.ndarray) -> np.ndarray:
    t = f.initializers[name]
    shape = tuple(int(d) for d in t.dims)
    count = int(np.prod(shape))
    if t.data_type not in FOUR_BIT or raw.ndim != 1 or raw.size != (count + 1) // 2:
        raise BlobError(f"onnx location: view 'nibbles' reads a packed int4/uint4 initializer first, not {name!r} here")
    return np.take(NIBBLES[t.data_type], raw, axis=0).reshape(-1)[:count].reshape(shape)


def apply_view(f: OnnxFile, name: str, arr: np.ndarray, view: str) -> np.ndarray:
    op, _, arg = view.partition("=")
    if op == "nibbles":
        return unpack_nibbles(f, name, arr)
    if op == "T" and arr.ndim == 2:
        return np.ascontiguousarray(arr.T)
    if op == "every" and arg.isdigit() and int(arg) > 0 and arr.ndim == 2:
        return np.ascontiguousarray(arr[:, :: int(arg)])
    if op == "fields" and arr.ndim >= 1 and arr.size > 0:
        bits, _, cols = arg.partition(":")
        if bits in ("2", "4", "8") and cols.isdigit():
            return unpack_fields(arr.reshape(arr.shape[0], -1).astype(np.uint8), int(bits), int(cols))
    if op == "sub" and arg.isdigit():
        return (arr.astype(np.int16) - int(arg)).astype(np.int8)
    raise BlobError(f"onnx location: unknown view {view!r} for {name!r} (shape {list(arr.shape)})")


@reader("onnx")
def _read(ref: BlobRef, rest: str, base: Path) -> bytes:
    where, _, views = rest.partition("@")
    rel, sep, name = where.partition("#")
    if not sep or not name:
        raise BlobError(f"onnx location must be FILE#INITIALIZER[@VIEW,...], found {rest!r}")
    f = open_cached(base, rel, "onnx", open_onnx)
    declared, want = f.initializers[name].data_type if name in f.initializers else None, ONNX_DTYPES.get(ref.dtype.name)
    if not views and declared is not None and want is not None and declared != want:  # bf16 declared UINT16 ...
        raise BlobError(
            f"{rel}: initializer {name!r} is data_type {declared}, but graph.qir reads it as {ref.dtype.name} "
            f"(data_type {want}): onnxruntime would read other values"
        )
    arr = as_array(f, name, initializer_bytes(f, name))
    for view in [v for v in views.split(",") if v]:
        arr = apply_view(f, name, arr, view)
    return np.ascontiguousarray(arr).tobytes()

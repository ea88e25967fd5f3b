"""Blob location schemes inside a safetensors artifact, used by its ``graph.qir``.

- ``safetensors:FILE#TENSOR``: the bytes of one tensor of ``FILE`` (relative to the artifact),
  read through the strict container reader (every gate runs when the file is first opened).
- ``ct-zero:FILE#TENSOR@BITS``: a compressed-tensors ``weight_zero_point`` (``I32``, packed along
  dim 0), unpacked to one signed code per byte in the IR's ``[N, groups]`` shape.

``read_blob`` then checks the length and sha256 of what these return against the tensor's
declaration, so ``graph.qir`` proves the container holds exactly the bytes the IR describes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qcompiler.backends.safetensors.container import ContainerError, SafetensorsFile, open_file
from qcompiler.errors import BlobError
from qcompiler.ir.blobs import open_cached, reader
from qcompiler.ir.core import BlobRef
from qcompiler.ir.layouts_ct import unpack_dim0


def opened(base: Path, rel: str) -> SafetensorsFile:
    """``rel`` inside ``base``, parsed once per (path, size, mtime) and gated strictly."""
    return open_cached(base, rel, "safetensors", open_file)


def split(rest: str) -> tuple[str, str]:
    rel, sep, name = rest.partition("#")
    if not sep or not name:
        raise BlobError(f"location must be FILE#TENSOR, found {rest!r}")
    return rel, name


@reader("safetensors")
def _read_tensor(ref: BlobRef, rest: str, base: Path) -> bytes:
    rel, name = split(rest)
    try:
        return bytes(opened(base, rel).read(name))
    except ContainerError as e:
        raise BlobError(str(e)) from None


@reader("ct-zero")
def _read_zero(ref: BlobRef, rest: str, base: Path) -> bytes:
    where, _, bits_s = rest.rpartition("@")
    if not bits_s.isdigit() or not 2 <= int(bits_s) <= 8 or len(ref.shape) != 2:
        raise BlobError(f"ct-zero location must be FILE#TENSOR@BITS (2-8) for a 2-D tensor, found {rest!r}")
    rel, name = split(where)
    n, g = ref.shape
    bits = int(bits_s)
    rows = -(-n * bits // 32)
    try:
        packed = np.asarray(opened(base, rel).array(name))
    except ContainerError as e:
        raise BlobError(str(e)) from None
    if packed.dtype != np.dtype("<i4") or packed.shape != (rows, g):
        raise BlobError(
            f"{rel}: tensor '{name}': zero points packed along dim 0 "
            f"(expected I32 [{rows}, {g}], found {packed.dtype} {list(packed.shape)})"
        )
    return np.ascontiguousarray(unpack_dim0(packed, bits, n), dtype=ref.dtype.numpy).tobytes()

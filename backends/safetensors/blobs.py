"""Blob location schemes inside a safetensors artifact, used by its ``graph.qir``.

- ``safetensors:FILE#TENSOR``: the bytes of one tensor of ``FILE`` (relative to the artifact),
  read through the strict container reader (every gate runs when the file is first opened).
- ``ct-zero:FILE#TENSOR@BITS``: a compressed-tensors ``weight_zero_point`` (``I32``, packed along
  dim 0), unpacked to one signed code per byte in the IR's ``[N, groups]`` shape.
- ``ct-scale:FILE#TENSOR``: a per-tensor ``weight_scale`` stored ``[1]`` (an FP8 ``tensor``
  strategy), read as the descriptor's all-ones qparam shape (``[1, 1]``).

Each read first checks the container's header entry against the IR's declaration: the dtype
(IR name -> safetensors name by ``ST_DTYPE``) and the shape must be the declared ones (a ``ct-zero``
entry: ``I32 [ceil(N*bits/32), groups]``), so a header edited with its bytes unchanged is refused.
``read_blob`` then checks the length and sha256 of what these return against the tensor's
declaration, so ``graph.qir`` proves the container holds exactly the bytes the IR describes.

``check_bound`` is the reader gates' other half: every tensor of a container file is referenced by
a location of ``graph.qir`` or checked by a named gate, and ``__metadata__`` is what the writers
write (``METADATA``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from qcompiler.artifact.reader import ArtifactError
from qcompiler.backends.safetensors.container import ContainerError, SafetensorsFile, TensorEntry, open_file
from qcompiler.backends.safetensors.layouts import unpack_dim0
from qcompiler.backends.safetensors.plan import ST_DTYPE
from qcompiler.errors import BlobError
from qcompiler.ir.blobs import open_cached, pieces, reader
from qcompiler.ir.core import BlobRef, Module

METADATA = {"format": "pt"}
"""The ``__metadata__`` every writer of this repository puts in a safetensors file, and all a reader accepts."""
SCHEMES = ("safetensors", "ct-zero", "ct-scale")


def opened(base: Path, rel: str) -> SafetensorsFile:
    """``rel`` inside ``base``, parsed once per (path, size, mtime) and gated strictly."""
    return open_cached(base, rel, "safetensors", open_file)


def split(rest: str) -> tuple[str, str]:
    rel, sep, name = rest.partition("#")
    if not sep or not name:
        raise BlobError(f"location must be FILE#TENSOR, found {rest!r}")
    return rel, name


def entry_of(f: SafetensorsFile, rel: str, name: str) -> TensorEntry:
    entry = f.tensors.get(name)
    if entry is None:
        raise BlobError(f"{rel}: tensor '{name}': no such tensor (found {len(f.tensors)} others)")
    return entry


def check_header(rel: str, name: str, entry: TensorEntry, dtype: str, shape: tuple[int, ...]) -> None:
    """The container's header entry must say ``dtype`` and ``shape`` (what ``graph.qir`` declares)."""
    for field, want, found in (("dtype", dtype, entry.dtype), ("shape", list(shape), list(entry.shape))):
        if want != found:
            raise BlobError(
                f"{rel}: tensor '{name}': {field}: the container header disagrees with graph.qir's declaration "
                f"(expected {want}, found {found})"
            )


def tensor_file(ref: BlobRef, rel: str, name: str, base: Path) -> SafetensorsFile:
    """The container holding ``name``, opened and gated, its header entry checked against ``ref``."""
    want = ST_DTYPE.get(ref.dtype.name)
    if want is None:
        raise BlobError(f"{rel}: tensor '{name}': dtype: {ref.dtype.name} has no safetensors dtype")
    f = opened(base, rel)
    check_header(rel, name, entry_of(f, rel, name), want, ref.shape)
    return f


@reader("safetensors")
def _read_tensor(ref: BlobRef, rest: str, base: Path) -> bytes:
    rel, name = split(rest)
    try:
        return bytes(tensor_file(ref, rel, name, base).read(name))
    except ContainerError as e:
        raise BlobError(str(e)) from None


@pieces("safetensors")
def _tensor_pieces(ref: BlobRef, rest: str, base: Path) -> Iterator[bytes]:
    rel, name = split(rest)
    try:
        yield from tensor_file(ref, rel, name, base).pieces(name)
    except ContainerError as e:
        raise BlobError(str(e)) from None


@reader("ct-scale")
def _read_scale(ref: BlobRef, rest: str, base: Path) -> bytes:
    rel, name = split(rest)
    if not all(d == 1 for d in ref.shape):
        raise BlobError(f"{rel}: tensor '{name}': a ct-scale location holds one value, declared {list(ref.shape)}")
    try:
        f = opened(base, rel)
        check_header(rel, name, entry_of(f, rel, name), ST_DTYPE.get(ref.dtype.name, ""), (1,))
        return bytes(f.read(name))
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
        f = opened(base, rel)
        check_header(rel, name, entry_of(f, rel, name), "I32", (rows, g))
        packed = np.asarray(f.array(name))
    except ContainerError as e:
        raise BlobError(str(e)) from None
    return np.ascontiguousarray(unpack_dim0(packed, bits, n), dtype=ref.dtype.numpy).tobytes()


def referenced(m: Module) -> dict[str, set[str]]:
    """File -> the tensors of it that ``m``'s ``safetensors:``/``ct-zero:`` locations read."""
    out: dict[str, set[str]] = {}
    for decl in m.tensors.values():
        scheme, _, rest = decl.blob.location.partition(":")
        if scheme in SCHEMES:
            where = rest.rpartition("@")[0] if scheme == "ct-zero" else rest
            rel, _, name = where.partition("#")
            out.setdefault(rel, set()).add(name)
    return out


def check_bound(rel: str, f: SafetensorsFile, m: Module, checked: set[str] | None = None) -> None:
    """Gate ``graph`` (binding): ``__metadata__`` is ``METADATA``, and every tensor of ``rel`` is read by
    a location of ``m`` or named in ``checked`` (tensors a gate checks by value, e.g. ``weight_shape``)."""
    if f.metadata != METADATA:
        raise ArtifactError(
            "__metadata__ is not what the writer writes",
            file=rel,
            field="__metadata__",
            expected=METADATA,
            found=f.metadata,
        )
    bound = referenced(m).get(rel, set()) | (checked or set())
    for name in f.tensors:
        if name not in bound:
            raise ArtifactError(
                f"tensor {name} is in {rel} but nothing binds it (graph.qir reads it nowhere, no gate checks it)",
                file=rel,
                tensor=name,
                expected="a tensor graph.qir references",
                found="unreferenced",
            )


def opened_checked(root: Path, rel: str) -> SafetensorsFile:
    """``rel`` opened as a blob reader opens it, a refusal as the artifact gate's error."""
    try:
        return opened(root, rel)
    except BlobError as e:
        raise ArtifactError(str(e), file=rel) from None

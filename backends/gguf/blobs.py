"""Blob locations inside a GGUF artifact, used by its ``graph.qir``:
``gguf:FILE#TENSOR[E]@PART[!neg|!sub1|!t|!row][!qk=H][~DTYPE]``.

``[E]`` picks the ``E``-th slab of a 3-D tensor (a MoE projection's experts stacked, ``archs_moe.py``).

``PART`` is a logical part of the tensor's blocks: ``codes`` (the bytes of the codec's ``code_fields``
of every block, which is the IR's ``ggml``/``ggml-k`` code layout), a qparam the block codec names
(``scale``, ``sub_scale``, ``sub_min``, ``d``, ``dmin``), or ``values`` (a dense tensor).
``!neg`` negates the part (Q4_1/Q5_1 store ``m`` where the IR's nested ``min`` is ``-m``);
``!sub1`` subtracts 1 from F32 values (Gemma's norms, which llama.cpp reads as ``1 + w``); ``!t``
transposes a 2-D ``values`` part (a ``Conv1D`` weight the IR keeps ``[K, N]`` as its source does,
which ggml holds as ``[N, K]`` rows: the declared shape is the transposed one); ``!row`` reads 1-D
``values`` ``[K]`` as the declared ``[1, K]`` (Qwen2-MoE's shared-expert gate, which llama.cpp holds 1-D);
``!qk=H`` undoes llama.cpp's Q/K row permutation for ``H`` heads (the IR keeps transformers' row
order); ``~DTYPE`` narrows a dense tensor the GGUF widened to F32 back to the IR's dtype (exact: its
values came from that dtype). Before any transform the part must have exactly the declared shape and
the declared dtype (``values`` of a ``~DTYPE`` tensor: F32), so a tensor info whose type or shape was
edited is refused even when the bytes are unchanged; ``values`` reads only a dense (F32/F16/BF16)
tensor and the other parts only a block type. ``read_blob`` then checks length and sha256 against
the declaration.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qcompiler.backends.gguf.archs_moe import stacked
from qcompiler.backends.gguf.codecs import get_codec
from qcompiler.backends.gguf.ggml_types import GGMLType, GGMLTypeError
from qcompiler.backends.gguf.reader import GGUFError, GGUFFile, open_gguf
from qcompiler.errors import BlobError
from qcompiler.ir.blobs import byte_view, open_cached, reader
from qcompiler.ir.core import BlobRef, Module
from qcompiler.ir.dtypes import DTYPES

DENSE_TYPES = {GGMLType.F32: "f32", GGMLType.F16: "f16", GGMLType.BF16: "bf16"}
"""ggml types read whole as ``values`` -> the IR dtype they hold (BF16 as raw bits)."""


def opened(base: Path, rel: str) -> GGUFFile:
    """``rel`` inside ``base``, parsed once per (path, size, mtime) by the strict GGUF reader."""
    return open_cached(base, rel, "gguf", open_gguf)


def as_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values that came from bfloat16 -> their bfloat16 bits (exact: the low half is zero)."""
    return (np.ascontiguousarray(values, dtype="<f4").view(np.uint32) >> 16).astype(np.uint16)


def inverse_rows(heads: int, rows: int) -> np.ndarray:
    from qcompiler.backends.gguf.archs import qk_row_permutation

    return np.argsort(qk_row_permutation(rows, heads))


def owned(part: str, expert: int | None) -> bool:
    """Whether ``part_of`` reads the part once into memory this process owns (a whole dense tensor),
    not a view of the file's map: what ``read_blob`` hashes is then what is used, and ``_read`` hands
    out a view of it rather than a copy."""
    return part == "values" and expert is None


def part_of(f: GGUFFile, name: str, part: str, expert: int | None = None) -> np.ndarray:
    """One logical part of tensor ``name`` (of its ``expert``-th slab when stacked); ``BlobError`` for a
    part its type does not have."""
    info = f.tensors.get(name)
    if info is None:
        raise BlobError(f"{f.path.name}: no tensor {name!r}")
    if expert is not None and not (len(info.shape) == 3 and 0 <= expert < info.shape[0]):
        raise BlobError(f"{f.path.name}: tensor {name!r}: no expert slab {expert} (shape {list(info.shape)})")
    gt = GGMLType(info.type_id)
    if (part == "values") != (gt in DENSE_TYPES):
        kind = "a dense type (F32, F16, BF16)" if part == "values" else "a block type"
        raise BlobError(f"{f.path.name}: tensor {name!r}: type: part {part!r} needs {kind} (found {gt.name})")
    if owned(part, expert):
        dtype = np.dtype(DTYPES[DENSE_TYPES[gt]].numpy).newbyteorder("<")
        return np.frombuffer(f.read(name), dtype=dtype).reshape(info.shape)
    raw = np.asarray(f.array(name))
    raw = raw if expert is None else raw[expert]
    if part == "values":
        return raw
    try:
        codec = get_codec(gt)
    except GGMLTypeError as e:
        raise BlobError(f"{f.path.name}: tensor {name!r}: type: {e}") from None
    blob = raw.reshape(-1, raw.shape[-1])
    if part == "codes":
        return codec.code_bytes(blob)
    parts = codec.split(blob)
    if part not in parts:
        raise BlobError(f"{f.path.name}: tensor {name!r} ({codec.type.name}) has no part {part!r}")
    return parts[part]


def check_declared(ref: BlobRef, rel: str, name: str, part: str, arr: np.ndarray, narrow: str) -> None:
    """The part as the container holds it must be what ``graph.qir`` declares: its shape, and its dtype
    (F32 when ``~DTYPE`` narrows it)."""
    want = np.dtype("<f4") if narrow else np.dtype(ref.dtype.numpy).newbyteorder("<")
    for field, expected, got in (("shape", list(ref.shape), list(arr.shape)), ("dtype", want.str, arr.dtype.str)):
        if expected != got:
            raise BlobError(
                f"{rel}: tensor '{name}': {field}: part {part!r} disagrees with graph.qir's declaration "
                f"(expected {expected}, found {got})"
            )


def referenced(m: Module) -> dict[str, set[str]]:
    """File -> the GGUF tensors ``m``'s ``gguf:`` locations read."""
    out: dict[str, set[str]] = {}
    for decl in m.tensors.values():
        scheme, _, rest = decl.blob.location.partition(":")
        if scheme == "gguf":
            rel, _, name = rest.partition("#")
            out.setdefault(rel, set()).add(stacked(name.rpartition("@")[0])[0])
    return out


@reader("gguf")
def _read(ref: BlobRef, rest: str, base: Path) -> bytes | memoryview:
    rest, _, narrow = rest.partition("~")
    rest, _, perm = rest.partition("!qk=")
    where, _, part = rest.rpartition("@")
    part, negate = part.removesuffix("!neg"), part.endswith("!neg")
    part, shifted = part.removesuffix("!sub1"), part.endswith("!sub1")
    part, flip = part.removesuffix("!t"), part.endswith("!t")
    part, row = part.removesuffix("!row"), part.endswith("!row")
    rel, sep, name = where.partition("#")
    if not sep or not name or not part:
        raise BlobError(f"gguf location must be FILE#TENSOR@PART, found {rest!r}")
    name, expert = stacked(name)
    try:
        arr = part_of(opened(base, rel), name, part, expert)
    except GGUFError as e:
        raise BlobError(str(e)) from None
    if flip and (part != "values" or arr.ndim != 2):
        raise BlobError(f"gguf location: '!t' transposes a 2-D values part, found {part!r} of rank {arr.ndim}")
    arr = arr.T if flip else arr
    if row and (part != "values" or arr.ndim != 1):
        raise BlobError(f"gguf location: '!row' reads 1-D values as one row, found {part!r} of rank {arr.ndim}")
    arr = arr[None, :] if row else arr
    check_declared(ref, rel, name, part, arr, narrow)
    if negate:
        arr = -arr
    if shifted:
        if arr.dtype != np.float32:
            raise BlobError(f"gguf location: '!sub1' reads F32 values, found {arr.dtype}")
        arr = arr - np.float32(1.0)
    if perm:
        if not perm.isdigit() or int(perm) <= 0 or arr.shape[0] % (2 * int(perm)):
            raise BlobError(f"gguf location: bad row permutation {perm!r} for {arr.shape[0]} rows")
        arr = arr[inverse_rows(int(perm), arr.shape[0])]
    if narrow:
        if narrow not in DTYPES:
            raise BlobError(f"gguf location: unknown dtype {narrow!r}")
        arr = as_bf16_bits(arr) if narrow == "bf16" else arr.astype(DTYPES[narrow].numpy)
    if owned(part, expert):
        return byte_view(arr)
    return np.ascontiguousarray(arr).tobytes()

"""The writer half of our safetensors codec (the reader and the shared tables are in ``container.py``).

Byte-identical to the reference writer: tensors ordered by dtype alignment descending, then name;
compact JSON with ``__metadata__`` first and the tensors in offset order; header padded with spaces to
a multiple of 8; metadata keys sorted. Input is validated with the reader's own rules, so we never
write a file our reader would refuse.

Example::

    >>> import pathlib, tempfile
    >>> from qcompiler.backends.safetensors.container import open_file
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "model.safetensors"
    >>> weight = TensorBytes("fc.weight", "F32", (2,), b"\\x00\\x00\\x80\\x3f" * 2)
    >>> with path.open("wb") as f:
    ...     f.writelines(serialize([weight], {"format": "pt"}))
    >>> st = open_file(path)
    >>> st.metadata, st.tensors["fc.weight"]
    ({'format': 'pt'}, TensorEntry(name='fc.weight', dtype='F32', shape=(2,), begin=0, end=8))
    >>> st.array("fc.weight").tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from qcompiler.backends.safetensors.container import (
    _ALIGN_RANK,
    MAX_HEADER_BYTES,
    METADATA_KEY,
    WRITER,
    _At,
    _check_metadata,
    _check_name,
    _check_shape,
    nbytes,
)


@dataclass(frozen=True)
class TensorBytes:
    """One tensor to write: ``data`` is exactly ``nbytes(dtype, shape)`` bytes, little-endian, C order,
    or a function that returns them (or an iterator of pieces of them) when the tensor's turn to be
    written comes (a streamed write holds one tensor, or one piece of one, at a time)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview | Callable[[], bytes | memoryview | Iterator[bytes | memoryview]]

    def payload(self) -> bytes | memoryview:
        """The bytes, checked against dtype and shape."""
        data = self.data() if callable(self.data) else self.data
        return self.checked(data if isinstance(data, bytes | memoryview) else b"".join(data))

    def pieces(self) -> Iterator[bytes | memoryview]:
        """``payload``, or the pieces the function gives, their total length checked after the last."""
        data = self.data() if callable(self.data) else self.data
        if isinstance(data, bytes | memoryview):
            yield self.checked(data)
            return
        got = 0
        for piece in data:
            got += memoryview(piece).nbytes
            yield piece
        self.check_length(got)

    def checked(self, data: bytes | memoryview) -> bytes | memoryview:
        view = memoryview(data)
        at = _At(WRITER, self.name)
        if not view.c_contiguous:
            raise at.error("data", "data must be C-contiguous")
        self.check_length(view.nbytes)
        return data if isinstance(data, bytes) else view.cast("B")

    def check_length(self, found: int) -> None:
        size = nbytes(self.dtype, self.shape, file=WRITER, tensor=self.name)
        if size != found:
            raise _At(WRITER, self.name).error(
                "data", "data length does not match dtype and shape", f"{size} bytes", f"{found} bytes"
            )


def layout(
    tensors: Sequence[TensorBytes], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[TensorBytes]]:
    """The 8-byte length prefix plus the space-padded header JSON, and the tensors in file order."""
    seen: set[str] = set()
    for tensor in tensors:
        _check_tensor(tensor, seen)
    ordered = sorted(tensors, key=lambda t: (-_ALIGN_RANK[t.dtype], t.name))
    header: dict[str, object] = {}
    if metadata is not None:
        _check_metadata(metadata, _At(WRITER))
        header[METADATA_KEY] = {key: metadata[key] for key in sorted(metadata)}
    for tensor, (begin, end) in zip(ordered, data_offsets(ordered), strict=True):
        header[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [begin, end]}
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise _At(WRITER).error("header", "header too large", f"<= {MAX_HEADER_BYTES} bytes", str(len(text)))
    return len(text).to_bytes(8, "little") + text, ordered


def serialize(
    tensors: Sequence[TensorBytes], metadata: Mapping[str, str] | None = None
) -> Iterator[bytes | memoryview]:
    """Yield the prefix+header chunk, then each tensor's data (in file order) as its own chunk, uncopied."""
    head, ordered = layout(tensors, metadata)
    return chunks(head, ordered)


def chunks(head: bytes, ordered: Sequence[TensorBytes]) -> Iterator[bytes | memoryview]:
    """``serialize``'s chunks for ``layout``'s result."""
    yield head
    for tensor in ordered:
        yield from tensor.pieces()


def data_offsets(ordered: Sequence[TensorBytes]) -> list[tuple[int, int]]:
    """Each tensor's ``[begin, end)`` in the data section, laid end to end in ``ordered``'s order."""
    out: list[tuple[int, int]] = []
    at = 0
    for tensor in ordered:
        end = at + nbytes(tensor.dtype, tensor.shape, file=WRITER, tensor=tensor.name)
        out.append((at, end))
        at = end
    return out


def file_offsets(head: bytes, ordered: Sequence[TensorBytes]) -> dict[str, int]:
    """Tensor name -> the file offset of its first byte, for ``layout``'s result."""
    return {t.name: len(head) + begin for t, (begin, _) in zip(ordered, data_offsets(ordered), strict=True)}


def _check_tensor(tensor: TensorBytes, seen: set[str]) -> None:
    name = _check_name(tensor.name, _At(WRITER))
    at = _At(WRITER, name)
    if name == METADATA_KEY:
        raise at.error("name", "name is reserved for the metadata")
    if name in seen:
        raise at.error("name", "duplicate tensor name", "unique names", f"{name!r} twice")
    seen.add(name)
    shape = _check_shape(tensor.shape, at)
    if callable(tensor.data):  # checked when its bytes are made (``payload``)
        nbytes(tensor.dtype, shape, file=WRITER, tensor=name)
        return
    view = memoryview(tensor.data)
    if not view.c_contiguous:
        raise at.error("data", "data must be C-contiguous")
    size = nbytes(tensor.dtype, shape, limit=view.nbytes, file=WRITER, tensor=name)
    if size != view.nbytes:
        raise at.error("data", "data length does not match dtype and shape", f"{size} bytes", f"{view.nbytes} bytes")

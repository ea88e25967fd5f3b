"""Block codecs for ggml types: quantize, dequantize, and the logical parts of every block.

A codec maps float32 rows ``(rows, n)`` to a type's bytes ``(rows, row_bytes)`` and back, all blocks at
once, quantizing exactly as ggml's ``quantize_row_*_ref`` (float32, operation by operation). ``split``
gives a blob's logical parts (codes and qparams, rows first) so the IR can describe a block without its
byte layout; ``join(split(b)) == b`` byte for byte (the repack proof); ``dequantize(b) == decode(split(b))``.
A codec's ``code_fields`` name the layout fields that hold codes: their bytes, block by block, are the
IR's ``ggml``/``ggml-k`` code layouts (``layouts``, ``layouts_k``) and a ``gguf:`` location's ``codes``
part (``blobs``); ``join_packed`` builds blocks from those bytes and the qparams without unpacking
the codes (``split_packed`` is its inverse). The nibble and ``qh`` bit packing of those fields
(``pack_nibbles``, ``pack_high_bits`` and their inverses) is here, once, for the codecs and the layouts.
Codecs register by declaration: the 256-element ones (TQ1_0, TQ2_0, Q4_K, Q5_K, Q6_K) are in ``codecs_k``,
the 32-element ones (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) in ``codecs_32``, F32, F16 and BF16 in ``codecs_plain``.

Example::

    >>> import numpy as np
    >>> from qcompiler.backends.gguf.codecs import get_codec
    >>> from qcompiler.backends.gguf.ggml_types import GGMLType
    >>> q4 = get_codec(GGMLType.Q4_0)
    >>> blob = q4.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64))
    >>> blob.shape
    (1, 36)
    >>> {name: (a.dtype.name, a.shape) for name, a in q4.split(blob).items()}
    {'codes': ('int8', (1, 64)), 'scale': ('float16', (1, 2))}
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from qcompiler.backends.gguf.ggml_types import BLOCKS, GGMLType, GGMLTypeError, row_bytes, row_elements

Array = npt.NDArray[Any]
Parts = dict[str, Array]
F32 = np.float32
CHUNK = 1 << 16
"""Quantize works on whole rows of about this many elements at a time (its temporaries stay in cache)."""
SPLIT_CHUNK = 1 << 22
"""``split`` and ``dequantize`` work on whole rows of about this many elements at a time: their
temporaries (several int16/float32 copies of the codes) follow the chunk, not the weight."""


@dataclass(frozen=True)
class Part:
    """A logical part of a block: each value covers ``group`` consecutive elements of a row (1 for
    codes); an integer part holds values in ``lo..hi`` (what its bit field can store)."""

    name: str
    dtype: str
    group: int
    lo: int | None = None
    hi: int | None = None


CODECS: dict[GGMLType, type[Codec]] = {}
"""Every registered codec, by ggml type: read it through ``codecs()``, which loads them."""
CODEC_MODULES = ("codecs_32", "codecs_k", "codecs_plain")
"""The modules whose ``Codec`` subclasses register themselves: Q8_0, Q4_0 ... Q5_1; the 256-element
K-quants and ternaries; F32, F16, BF16. Imported on the first lookup, not at the end of this file."""


@functools.cache
def codecs() -> dict[GGMLType, type[Codec]]:
    """Every codec, by ggml type (``CODEC_MODULES`` imported once)."""
    for name in CODEC_MODULES:
        importlib.import_module(f"{__package__}.{name}")
    return CODECS


def get_codec(t: GGMLType) -> type[Codec]:
    """The codec of ``t``; ``GGMLTypeError`` naming ``t`` when there is none."""
    codec = codecs().get(t)
    if codec is None:
        known = ", ".join(c.name for c in sorted(CODECS))
        raise GGMLTypeError(f"no codec for ggml type {t.name} (id {int(t)}); codecs exist for {known}")
    return codec


class Codec:
    """Base of the codecs. A subclass declares its byte ``layout`` ((field, bytes) in block order) and
    ``parts``, and implements the block hooks on ``(blocks, ...)`` arrays: ``_encode`` (float32 -> parts,
    the reference quantizer), ``_pack``/``_unpack`` (parts <-> bytes) and ``_decode`` (parts -> float32).
    A subclass declared without ``type`` is an abstract family base and is not registered."""

    type: ClassVar[GGMLType]
    block: ClassVar[int]
    nbytes: ClassVar[int]
    layout: ClassVar[tuple[tuple[str, int], ...]]
    code_fields: ClassVar[tuple[str, ...]] = ()
    """The ``layout`` fields that hold codes, in layout order (the others hold qparams)."""
    parts: ClassVar[tuple[Part, ...]]
    can_quantize: ClassVar[bool] = True
    views: ClassVar[bool] = False
    """``split`` gives views of the blob (float codecs): nothing to chunk."""
    finite_only: ClassVar[bool] = True
    """Quantize refuses non-finite input and float16 parameters that overflow (all but float codecs)."""

    def __init_subclass__(cls, *, type: GGMLType | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if type is None:
            return
        if type in CODECS:
            raise GGMLTypeError(f"{type.name}: codec {CODECS[type].__name__} is already registered")
        cls.type = type
        cls.block, cls.nbytes = BLOCKS[type]
        assert sum(size for _, size in cls.layout) == cls.nbytes, f"{type.name}: layout is not {cls.nbytes} bytes"
        in_order = tuple(name for name, _ in cls.layout if name in cls.code_fields)
        assert in_order == cls.code_fields, f"{type.name}: code_fields are not layout fields in layout order"
        CODECS[type] = cls

    @classmethod
    def quantize(cls, x: npt.ArrayLike) -> npt.NDArray[np.uint8]:
        """float rows ``(rows, n)`` -> bytes ``(rows, row_bytes)``, exactly as ggml's reference quantizer."""
        if not cls.can_quantize:
            raise GGMLTypeError(f"{cls.type.name}: quantize is not implemented (dequantize, split and join are)")
        rows = np.ascontiguousarray(x, dtype=F32)
        if rows.ndim != 2:
            raise GGMLTypeError(f"{cls.type.name}: quantize expects rows (rows, n), found shape {rows.shape}")
        out = np.empty((rows.shape[0], row_bytes(cls.type, rows.shape[1])), dtype=np.uint8)
        step = max(1, CHUNK // max(1, rows.shape[1]))
        for start in range(0, rows.shape[0] if rows.size else 0, step):  # whole rows, all their blocks at once
            chunk = rows[start : start + step]
            with np.errstate(all="ignore"):  # non-finite input and float16 overflow are refused below
                parts = cls._encode(chunk.reshape(-1, cls.block))
            if cls.finite_only:
                cls._refuse_nonfinite(chunk, parts, start)
            out[start : start + step] = cls._pack(parts).reshape(chunk.shape[0], -1)
        return out

    @classmethod
    def _refuse_nonfinite(cls, chunk: Array, parts: Parts, start: int) -> None:
        """ggml would write inf/NaN for non-finite input or a float16 parameter that overflows: refuse."""
        params = [(f"float16 {p.name} of the block", parts[p.name], p.group) for p in cls.parts if p.dtype == "float16"]
        for what, a, group in [("input value", chunk, 1), *params]:
            bad = np.flatnonzero(~np.isfinite(a))
            if bad.size:
                r, c = divmod(int(bad[0]) * group, chunk.shape[1])
                raise GGMLTypeError(f"{cls.type.name}: non-finite {what} at row {start + r}, column {c}")

    @classmethod
    def dequantize(cls, blob: npt.ArrayLike) -> npt.NDArray[np.float32]:
        """bytes ``(rows, row_bytes)`` -> float32 ``(rows, n)``; the same as ``decode(split(blob))``,
        computed ``SPLIT_CHUNK`` elements of whole rows at a time."""
        data = cls._rows(blob)
        rows, n = data.shape[0], row_elements(cls.type, data.shape[1])
        step = cls._step(n)
        if cls.views or rows <= step:
            return cls.decode(cls.split(data))
        out = np.empty((rows, n), dtype=F32)
        for r0 in range(0, rows, step):
            out[r0 : r0 + step] = cls.decode(cls.split(data[r0 : r0 + step]))
        return out

    @classmethod
    def split(cls, blob: npt.ArrayLike) -> dict[str, Array]:
        """bytes ``(rows, row_bytes)`` -> ``{part: (rows, n // part.group)}`` in ``parts`` order (float codecs:
        views of ``blob``, not copies; others ``SPLIT_CHUNK`` elements of whole rows at a time)."""
        data = cls._rows(blob)
        rows, n = data.shape[0], row_elements(cls.type, data.shape[1])
        step = cls._step(n)
        if cls.views or rows <= step:
            return cls._split(data, rows, n)
        out = {p.name: np.empty((rows, n // p.group), dtype=p.dtype) for p in cls.parts}
        for r0 in range(0, rows, step):
            chunk = data[r0 : r0 + step]
            for name, a in cls._split(chunk, chunk.shape[0], n).items():
                out[name][r0 : r0 + step] = a
        return out

    @classmethod
    def _rows(cls, blob: npt.ArrayLike) -> Array:
        data = np.ascontiguousarray(blob)
        if data.dtype != np.uint8 or data.ndim != 2:
            raise GGMLTypeError(f"{cls.type.name}: expected uint8 rows (rows, bytes), found {data.dtype} {data.shape}")
        return data

    @classmethod
    def _step(cls, n: int) -> int:
        return max(1, SPLIT_CHUNK // max(1, n))

    @classmethod
    def _split(cls, data: Array, rows: int, n: int) -> dict[str, Array]:
        empty = {p.name: np.zeros(0, p.dtype) for p in cls.parts}
        parts = cls._unpack(data.reshape(-1, cls.nbytes)) if data.size else empty
        return {p.name: np.ascontiguousarray(parts[p.name]).reshape(rows, n // p.group) for p in cls.parts}

    @classmethod
    def join(cls, parts: dict[str, Array]) -> npt.NDArray[np.uint8]:
        """The inverse of ``split``: parts (names, dtypes, shapes and integer ranges checked) -> bytes,
        ``SPLIT_CHUNK`` elements of whole rows at a time."""
        rows, blocks = cls._check_parts(parts, ranges=True)
        if rows * blocks == 0:
            return np.zeros((rows, blocks * cls.nbytes), np.uint8)
        step = cls._step(blocks * cls.block)
        if cls.views or rows <= step:
            return cls._pack(cls._blocks(parts)).reshape(rows, blocks * cls.nbytes)
        out = np.empty((rows, blocks * cls.nbytes), np.uint8)
        for r0 in range(0, rows, step):  # whole rows, SPLIT_CHUNK elements at a time
            chunk = {name: a[r0 : r0 + step] for name, a in parts.items()}
            out[r0 : r0 + step] = cls._pack(cls._blocks(chunk)).reshape(-1, blocks * cls.nbytes)
        return out

    @classmethod
    def decode(cls, parts: dict[str, Array]) -> npt.NDArray[np.float32]:
        """The reference reconstruction of ``parts``: float32 rows ``(rows, n)``."""
        rows, blocks = cls._check_parts(parts, ranges=False)
        if rows * blocks == 0:
            return np.zeros((rows, blocks * cls.block), dtype=F32)
        with np.errstate(all="ignore"):  # inf/NaN parameters decode to inf/NaN, as in ggml
            return cls._decode(cls._blocks(parts)).astype(F32, copy=False).reshape(rows, blocks * cls.block)

    @classmethod
    def _encode(cls, x: Array) -> Parts: ...

    @classmethod
    def _pack(cls, p: Parts) -> Array: ...

    @classmethod
    def _unpack(cls, b: Array) -> Parts: ...

    @classmethod
    def _decode(cls, p: Parts) -> Array: ...

    @classmethod
    def _param_fields(cls, p: Parts) -> Parts:
        """The qparam parts of blocks ``(blocks, block // group)`` -> the layout fields that are not
        ``code_fields`` (uint8 ``(blocks, size)``); ``_pack`` and ``join_packed`` both write them so."""
        raise NotImplementedError(f"{cls.type.name}: no qparam fields")

    @classmethod
    def _params(cls, f: Parts) -> Parts:
        """The inverse of ``_param_fields``: layout fields -> the qparam parts of the blocks."""
        raise NotImplementedError(f"{cls.type.name}: no qparam fields")

    @classmethod
    def canonical_code_bytes(cls, code: Array) -> Array:
        """Code bytes ``(rows, blocks * code_size)`` as ``join`` writes the codes they hold: the same bytes
        (TQ1_0 overrides it: a non-canonical byte becomes the canonical one with the same trits)."""
        return code

    @classmethod
    def join_packed(cls, code: Array, params: Parts) -> npt.NDArray[np.uint8]:
        """Bytes ``(rows, row_bytes)`` from the code bytes of every block ``(rows, blocks * code_size)``
        (``code_bytes``: the ``ggml``/``ggml-k`` layouts) and the qparam parts (as ``split`` gives them,
        checked as ``join`` checks them): the code bytes go into their fields as they are, never
        unpacked to codes. ``join_packed(code_bytes(b), qparams of split(b)) == join(split(b))``."""
        raw = np.asarray(code)
        size = cls.code_size()
        if not size or raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % size:
            raise GGMLTypeError(
                f"{cls.type.name}: expected code bytes uint8 (rows, blocks * {size}), found {raw.dtype} {raw.shape}"
            )
        rows, blocks = raw.shape[0], raw.shape[1] // size
        cls._check_parts(params, ranges=True, codes=(rows, blocks))
        fields = cls.split_code_bytes(cls.canonical_code_bytes(raw).reshape(-1, size))
        fields |= cls._param_fields({name: a.reshape(rows * blocks, -1) for name, a in params.items()})
        return cls._assemble(fields).reshape(rows, blocks * cls.nbytes)

    @classmethod
    def split_packed(cls, blob: npt.ArrayLike) -> tuple[Array, Parts]:
        """The inverse of ``join_packed``: bytes -> (code bytes ``(rows, blocks * code_size)``, the qparam
        parts ``(rows, n // group)``), the codes left packed."""
        data = cls._rows(blob)
        rows = data.shape[0]
        f = cls._fields(data.reshape(-1, cls.nbytes))
        params = {name: np.ascontiguousarray(a).reshape(rows, -1) for name, a in cls._params(f).items()}
        return cls.join_code_fields(f).reshape(rows, -1), params

    @classmethod
    def _fields(cls, b: Array) -> dict[str, Array]:
        """Blocks ``(blocks, nbytes)`` -> their layout fields, each a contiguous ``(blocks, size)``."""
        cuts = np.cumsum([size for _, size in cls.layout])[:-1]
        return {name: a.copy() for (name, _), a in zip(cls.layout, np.split(b, cuts, axis=1), strict=True)}

    @classmethod
    def _assemble(cls, fields: dict[str, Array]) -> Array:
        """Layout fields (uint8, ``(blocks, size)``) -> blocks ``(blocks, nbytes)`` in layout order."""
        return np.concatenate([fields[name].reshape(-1, size) for name, size in cls.layout], axis=1)

    @classmethod
    def pack_codes(cls, u: Array) -> Parts:
        """Stored code values ``(blocks, block)`` (uint8) -> the code fields (the 32-element codecs)."""
        raise NotImplementedError(f"{cls.type.name}: codes are packed by join, not pack_codes")

    @classmethod
    def unpack_codes(cls, f: Parts) -> Array:
        """The inverse of ``pack_codes``: the code fields -> stored code values ``(blocks, block)`` (uint8)."""
        raise NotImplementedError(f"{cls.type.name}: codes are unpacked by split, not unpack_codes")

    @classmethod
    def code_size(cls) -> int:
        """Bytes of ``code_fields`` per block."""
        return sum(size for name, size in cls.layout if name in cls.code_fields)

    @classmethod
    def split_code_bytes(cls, code: Array) -> dict[str, Array]:
        """Code bytes ``(blocks, code_size)`` -> the code fields, each a contiguous ``(blocks, size)``."""
        sizes = [size for name, size in cls.layout if name in cls.code_fields]
        pieces = np.split(np.asarray(code, dtype=np.uint8), np.cumsum(sizes)[:-1], axis=1)
        return {name: np.ascontiguousarray(a) for name, a in zip(cls.code_fields, pieces, strict=True)}

    @classmethod
    def join_code_fields(cls, fields: dict[str, Array]) -> Array:
        """The inverse of ``split_code_bytes``: code fields -> code bytes ``(blocks, code_size)``."""
        return np.concatenate(
            [fields[name].reshape(-1, size) for name, size in cls.layout if name in cls.code_fields], 1
        )

    @classmethod
    def code_bytes(cls, blob: Array) -> Array:
        """Bytes ``(rows, row_bytes)`` -> the code fields of every block: ``(rows, blocks * code_size)``."""
        rows, width = blob.shape
        code = cls.join_code_fields(cls._fields(np.asarray(blob, dtype=np.uint8).reshape(-1, cls.nbytes)))
        return code.reshape(rows, width // cls.nbytes * cls.code_size())

    @classmethod
    def _blocks(cls, parts: dict[str, Array]) -> Parts:
        return {p.name: parts[p.name].reshape(-1, cls.block // p.group) for p in cls.parts}

    @classmethod
    def _check_parts(
        cls, parts: dict[str, Array], *, ranges: bool, codes: tuple[int, int] | None = None
    ) -> tuple[int, int]:
        """(rows, blocks per row) of ``parts``, after checking them against ``cls.parts`` (all but
        ``codes`` when ``codes`` gives the (rows, blocks per row) of packed code bytes)."""
        expected_parts = [p for p in cls.parts if codes is None or p.name != "codes"]
        name, want = cls.type.name, [p.name for p in expected_parts]
        if sorted(parts) != sorted(want):
            raise GGMLTypeError(f"{name}: expected parts {want}, found {sorted(parts)}")
        first = np.shape(parts[want[0]])
        rows, blocks = codes or ((first[0], first[1] // cls.block) if len(first) == 2 else (0, 0))
        for p in expected_parts:
            a, expected = parts[p.name], (rows, blocks * cls.block // p.group)
            if a.dtype != np.dtype(p.dtype) or a.shape != expected:
                raise GGMLTypeError(f"{name} part {p.name!r}: expected {p.dtype} {expected}, found {a.dtype} {a.shape}")
            if ranges and a.size and p.lo is not None and p.hi is not None and (a.min() < p.lo or a.max() > p.hi):
                raise GGMLTypeError(f"{name} part {p.name!r}: values must lie in [{p.lo}, {p.hi}]")
        return rows, blocks


def row_slices(n: int, k: int) -> list[tuple[int, int]]:
    """``(r0, r1)`` of about ``SPLIT_CHUNK`` elements each (at least one row; one slice when empty)."""
    step = max(1, SPLIT_CHUNK // max(k, 1))
    return [(r0, min(n, r0 + step)) for r0 in range(0, n, step)] or [(0, 0)]


def f16_bytes(values: Array) -> Array:
    """float16 ``(blocks, k)`` -> little-endian bytes ``(blocks, 2k)``."""
    return np.ascontiguousarray(values, dtype="<f2").view(np.uint8)


def f16_of(raw: Array) -> Array:
    """Little-endian bytes ``(blocks, 2k)`` -> float16 ``(blocks, k)``."""
    return np.ascontiguousarray(raw).view("<f2").astype(np.float16)


def recip(d: Array) -> Array:
    """ggml's ``id = d ? 1.0f/d : 0.0f`` in float32."""
    out = np.zeros_like(d, dtype=F32)
    return np.divide(F32(1), d, out=out, where=d != 0)


def roundf(v: Array) -> Array:
    """C ``roundf`` (half away from zero), exact for every float32."""
    a = np.abs(v)
    whole = np.floor(a)
    return np.copysign(whole + (a - whole >= F32(0.5)), v).astype(F32)


def pack_nibbles(u: Array, chunk: int) -> Array:
    """The low 4 bits of ``(blocks, n)`` values -> ``(blocks, n/2)`` bytes (ggml's ``qs``/``ql``): per
    ``chunk`` elements, byte ``l`` = element ``l`` | element ``l + chunk/2`` << 4."""
    h = u.astype(np.uint8, copy=False).reshape(u.shape[0], -1, 2, chunk // 2)
    return ((h[:, :, 0] & np.uint8(15)) | (h[:, :, 1] << np.uint8(4))).reshape(u.shape[0], -1)


def unpack_nibbles(raw: Array, chunk: int) -> Array:
    """The inverse of ``pack_nibbles``: ``(blocks, n/2)`` bytes -> ``(blocks, n)`` values 0..15."""
    r = raw.reshape(raw.shape[0], -1, 1, chunk // 2)
    return np.concatenate([r & np.uint8(15), r >> np.uint8(4)], axis=2).reshape(raw.shape[0], -1)


def pack_high_bits(u: Array) -> Array:
    """Bit 4 of ``(blocks, 32)`` values -> Q5_0/Q5_1's ``qh`` ``(blocks, 4)``: u32 LE bit ``j`` = element ``j``."""
    return np.packbits((u.astype(np.uint8, copy=False) >> np.uint8(4)) & np.uint8(1), axis=1, bitorder="little")


def unpack_high_bits(qh: Array) -> Array:
    """The inverse of ``pack_high_bits``: ``qh`` ``(blocks, 4)`` -> ``(blocks, 32)`` values 0 or 16 (bit 4 in place)."""
    return np.unpackbits(qh, axis=1, bitorder="little") << np.uint8(4)

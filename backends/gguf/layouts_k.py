"""ggml's K-quant code layouts (``pack=(family=ggml-k, version=1, encoding=q4_k, tile=[1,256])``): the
code bytes of each 256-element super-block in llama.cpp's order, without its scales.

| encoding | codes | code fields per 256 (bytes) |
|---|---|---|
| ``q4_k`` | u4 [0:15] | ``qs`` (128) |
| ``q5_k`` | u5 [0:31] | ``qh`` (32), ``qs`` (128) |
| ``q6_k`` | i6 [-32:31] | ``ql`` (128), ``qh`` (64) |
| ``tq2_0`` | i2 {-1,0,1} | ``qs`` (64) |
| ``tq1_0`` | i2 {-1,0,1} | ``qs`` (48), ``qh`` (4): 5 trits per byte |

The bit order is the block codec's (``codecs_k``): packing joins the codes with zero qparams and keeps
the code fields; unpacking puts zero qparam fields back and splits. The codecs are the single source
of the bit layout, so layout and container cannot disagree.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qcompiler.backends.gguf.codecs import get_codec, row_slices
from qcompiler.backends.gguf.ggml_types import GGMLType
from qcompiler.ir.dtypes import DTYPES, DType
from qcompiler.ir.layouts import Layout
from qcompiler.ir.types import QuantType

CODE_FIELDS = {"q4_k": ("qs",), "q5_k": ("qh", "qs"), "q6_k": ("ql", "qh"), "tq2_0": ("qs",), "tq1_0": ("qs", "qh")}
QK = 256


def codec_of(t: QuantType) -> Any:
    return get_codec(GGMLType[t.pack.encoding.upper()])


def code_bytes(encoding: str) -> int:
    codec = get_codec(GGMLType[encoding.upper()])
    return sum(size for name, size in codec.layout if name in CODE_FIELDS[encoding])


class GgmlKBlocks(Layout, family="ggml-k", version=1):
    """The code bytes of ggml's K-quant super-blocks (see the module docstring)."""

    encodings = tuple(CODE_FIELDS)

    @classmethod
    def row_axis(cls, t: QuantType) -> int | None:
        return 0

    @classmethod
    def physical(cls, t: QuantType) -> tuple[DType, tuple[int, ...]]:
        n, k = (int(d) for d in t.shape)
        return DTYPES["u8"], (n, k // QK * code_bytes(t.pack.encoding))

    @classmethod
    def pack(cls, codes: np.ndarray, t: QuantType) -> np.ndarray:
        """Codes ``(N, K)`` -> code bytes ``(N, K/256 * bytes)``, a slice of rows at a time."""
        n, k = codes.shape
        out = np.empty(cls.physical(t)[1], np.uint8)
        for r0, r1 in row_slices(n, k):
            out[r0:r1] = cls._pack_rows(codes[r0:r1], t)
        return out

    @classmethod
    def _pack_rows(cls, codes: np.ndarray, t: QuantType) -> np.ndarray:
        codec = codec_of(t)
        n, k = codes.shape
        parts = {p.name: np.zeros((n, k // p.group), dtype=p.dtype) for p in codec.parts}
        parts["codes"] = np.ascontiguousarray(codes, dtype=codec.parts[0].dtype)
        fields = codec._fields(codec.join(parts).reshape(-1, codec.nbytes))
        keep = [fields[name] for name, _ in codec.layout if name in CODE_FIELDS[t.pack.encoding]]
        return np.concatenate(keep, axis=1).reshape(n, -1)

    @classmethod
    def unpack(cls, blob: np.ndarray, t: QuantType) -> np.ndarray:
        """Code bytes -> codes ``(N, K)``, a slice of rows at a time."""
        n, k = (int(d) for d in t.shape)
        raw = np.ascontiguousarray(blob, dtype=np.uint8).reshape(n, -1)
        out = np.empty((n, k), dtype=codec_of(t).parts[0].dtype)
        for r0, r1 in row_slices(n, k):
            out[r0:r1] = cls._unpack_rows(raw[r0:r1], t)
        return out

    @classmethod
    def _unpack_rows(cls, blob: np.ndarray, t: QuantType) -> np.ndarray:
        codec = codec_of(t)
        raw = blob.reshape(-1, code_bytes(t.pack.encoding))
        cuts = np.cumsum([size for name, size in codec.layout if name in CODE_FIELDS[t.pack.encoding]])[:-1]
        given = dict(zip(CODE_FIELDS[t.pack.encoding], np.split(raw, cuts, axis=1), strict=True))
        fields = {name: given.get(name, np.zeros((raw.shape[0], size), np.uint8)) for name, size in codec.layout}
        blocks = codec._assemble(fields).reshape(blob.shape[0], -1)
        return codec.split(blocks)["codes"]

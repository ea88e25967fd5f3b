"""ggml's K-quant code layouts (``pack=(family=ggml-k, version=1, encoding=q4_k, tile=[1,256])``): the
code bytes of each 256-element super-block in llama.cpp's order, without its scales.

| encoding | codes | code fields per 256 (bytes) |
|---|---|---|
| ``q4_k`` | u4 [0:15] | ``qs`` (128) |
| ``q5_k`` | u5 [0:31] | ``qh`` (32), ``qs`` (128) |
| ``q6_k`` | i6 [-32:31] | ``ql`` (128), ``qh`` (64) |
| ``tq2_0`` | i2 {-1,0,1} | ``qs`` (64) |
| ``tq1_0`` | i2 {-1,0,1} | ``qs`` (48), ``qh`` (4): 5 trits per byte |

The bit order is the block codec's (``codecs_k``), and so is the list of code fields (its
``code_fields``): packing joins the codes with zero qparams and keeps the code fields; unpacking puts
zero qparam fields back and splits. The codecs are the single source of the bit layout, so layout and
container cannot disagree.
"""

from __future__ import annotations

import numpy as np

from qcompiler.backends.gguf.codecs import Codec, get_codec, row_slices
from qcompiler.backends.gguf.ggml_types import GGMLType
from qcompiler.ir.dtypes import DTYPES, DType
from qcompiler.ir.layouts import Layout
from qcompiler.ir.types import QuantType

ENCODINGS = ("q4_k", "q5_k", "q6_k", "tq2_0", "tq1_0")
QK = 256


def codec_of(t: QuantType) -> type[Codec]:
    return get_codec(GGMLType[t.pack.encoding.upper()])


def code_bytes(encoding: str) -> int:
    return get_codec(GGMLType[encoding.upper()]).code_size()


class GgmlKBlocks(Layout, family="ggml-k", version=1):
    """The code bytes of ggml's K-quant super-blocks (see the module docstring)."""

    encodings = ENCODINGS

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
        return codec.code_bytes(codec.join(parts))

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
        raw = blob.reshape(-1, codec.code_size())
        given = codec.split_code_bytes(raw)
        fields = {name: given.get(name, np.zeros((raw.shape[0], size), np.uint8)) for name, size in codec.layout}
        blocks = codec._assemble(fields).reshape(blob.shape[0], -1)
        return codec.split(blocks)["codes"]

"""ggml's code layouts (``pack=(family=ggml, version=1, encoding=q4_0, tile=[1,32])``): the *code* bytes of
each 32-element block, in the order llama.cpp stores them; a block's qparams (``d``, ``m``) are not
part of the codes blob, the GGUF container interleaves them.

| encoding | codes | bytes per 32 codes |
|---|---|---|
| ``q8_0`` | i8 [-128:127] | 32: one byte per code (two's complement) |
| ``q4_0`` / ``q4_1`` | i4 [-8:7] / u4 [0:15] | 16: byte ``j`` low nibble = code ``j``, high = code ``j+16`` |
| ``q5_0`` / ``q5_1`` | i5 [-16:15] / u5 [0:31] | 20: ``qh`` u32 LE (bit j = bit 4 of code j), then 16 as for 4 bits |

Signed 4/5-bit codes are stored as ``u = q + 2^(bits-1)``. The bytes are the block codec's code
fields (``codecs_32``: ``code_fields``, packed by its ``pack_codes``), so layout and container cannot
disagree.

The physical blob is ``u8[N, K/32 * bytes]``; ``K`` must be a multiple of 32.
"""

from __future__ import annotations

import numpy as np

from qcompiler.backends.gguf.codecs import get_codec
from qcompiler.backends.gguf.ggml_types import GGMLType
from qcompiler.ir.dtypes import DTYPES, DType
from qcompiler.ir.layouts import Layout
from qcompiler.ir.types import QuantType

BLOCK = 32
BLOCK_CODECS = {enc: get_codec(GGMLType[enc.upper()]) for enc in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")}
"""The block codec of each encoding: its code fields, in its layout's order, are the blob's bytes."""
CODE_BYTES = {enc: codec.code_size() for enc, codec in BLOCK_CODECS.items()}
"""Code bytes per 32-element block, by encoding."""


def offset(t: QuantType) -> int:
    """What is added to a code to store it unsigned (``2^(bits-1)`` for signed 4/5-bit codes; ``q8_0``
    stores two's complement)."""
    signed = t.code.dtype.signed and t.pack.encoding != "q8_0"
    return 1 << (t.code.dtype.bits - 1) if signed and t.code.dtype.bits < 8 else 0


class GgmlBlocks(Layout, family="ggml", version=1):
    """The code bytes of ggml's 32-element blocks (see the module docstring)."""

    encodings = tuple(BLOCK_CODECS)

    @classmethod
    def row_axis(cls, t: QuantType) -> int | None:
        return 0

    @classmethod
    def physical(cls, t: QuantType) -> tuple[DType, tuple[int, ...]]:
        n, k = (int(d) for d in t.shape)
        return DTYPES["u8"], (n, k // BLOCK * CODE_BYTES[t.pack.encoding])

    @classmethod
    def pack(cls, codes: np.ndarray, t: QuantType) -> np.ndarray:
        n, k = codes.shape
        codec = BLOCK_CODECS[t.pack.encoding]
        u = (codes.reshape(-1, BLOCK).astype(np.int16) + offset(t)).astype(np.uint8)
        return codec.join_code_fields(codec.pack_codes(u)).reshape(n, k // BLOCK * codec.code_size())

    @classmethod
    def unpack(cls, blob: np.ndarray, t: QuantType) -> np.ndarray:
        n, k = (int(d) for d in t.shape)
        enc = t.pack.encoding
        codec = BLOCK_CODECS[enc]
        raw = np.ascontiguousarray(blob, dtype=np.uint8).reshape(-1, CODE_BYTES[enc])
        u = codec.unpack_codes(codec.split_code_bytes(raw))
        if enc == "q8_0":
            return u.view(np.int8).reshape(n, k).copy()
        codes = u.astype(np.int16) - offset(t)
        return codes.astype(np.int8 if t.code.dtype.signed else np.uint8).reshape(n, k)

"""ggml's code layouts (``pack=(family=ggml, version=1, encoding=q4_0, tile=[1,32])``): the *code* bytes of
each 32-element block, in the order llama.cpp stores them; a block's qparams (``d``, ``m``) are not
part of the codes blob, the GGUF container interleaves them.

| encoding | codes | bytes per 32 codes |
|---|---|---|
| ``q8_0`` | i8 [-128:127] | 32: one byte per code (two's complement) |
| ``q4_0`` / ``q4_1`` | i4 [-8:7] / u4 [0:15] | 16: byte ``j`` low nibble = code ``j``, high = code ``j+16`` |
| ``q5_0`` / ``q5_1`` | i5 [-16:15] / u5 [0:31] | 20: ``qh`` u32 LE (bit j = bit 4 of code j), then 16 as for 4 bits |

Signed 4/5-bit codes are stored as ``u = q + 2^(bits-1)``.

The physical blob is ``u8[N, K/32 * bytes]``; ``K`` must be a multiple of 32.
"""

from __future__ import annotations

import numpy as np

from qcompiler.ir.dtypes import DTYPES, DType
from qcompiler.ir.layouts import Layout
from qcompiler.ir.types import QuantType

BLOCK = 32
CODE_BYTES = {"q8_0": 32, "q4_0": 16, "q4_1": 16, "q5_0": 20, "q5_1": 20}
"""Code bytes per 32-element block, by encoding."""


def offset(t: QuantType) -> int:
    """What is added to a code to store it unsigned (``2^(bits-1)`` for signed 4/5-bit codes)."""
    return 1 << (t.code.dtype.bits - 1) if t.code.dtype.signed and t.code.dtype.bits < 8 else 0


def nibbles(u: np.ndarray) -> np.ndarray:
    """``(blocks, 32)`` values < 16 -> ``(blocks, 16)`` bytes: low = element j, high = element j+16."""
    return (u[:, :16] | (u[:, 16:] << 4)).astype(np.uint8)


def unnibble(b: np.ndarray) -> np.ndarray:
    return np.concatenate([b & 0x0F, b >> 4], axis=1).astype(np.uint8)


class GgmlBlocks(Layout, family="ggml", version=1):
    """The code bytes of ggml's 32-element blocks (see the module docstring)."""

    encodings = tuple(CODE_BYTES)

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
        enc = t.pack.encoding
        blocks = codes.reshape(-1, BLOCK).astype(np.int16)
        if enc == "q8_0":
            return blocks.astype(np.int8).view(np.uint8).reshape(n, k)
        u = (blocks + offset(t)).astype(np.uint8)
        qs = nibbles(u & 0x0F)
        if enc in ("q4_0", "q4_1"):
            return qs.reshape(n, -1)
        high = ((u >> 4) & 1).astype(np.uint32) << np.arange(BLOCK, dtype=np.uint32)
        qh = np.bitwise_or.reduce(high, axis=1).astype("<u4").view(np.uint8).reshape(-1, 4)
        return np.concatenate([qh, qs], axis=1).reshape(n, -1)

    @classmethod
    def unpack(cls, blob: np.ndarray, t: QuantType) -> np.ndarray:
        n, k = (int(d) for d in t.shape)
        enc = t.pack.encoding
        raw = np.ascontiguousarray(blob, dtype=np.uint8).reshape(-1, CODE_BYTES[enc])
        if enc == "q8_0":
            return raw.view(np.int8).reshape(n, k).copy()
        if enc in ("q4_0", "q4_1"):
            u = unnibble(raw).astype(np.int16)
        else:
            qh = raw[:, :4].copy().view("<u4")
            high = ((qh >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.int16)
            u = unnibble(raw[:, 4:]).astype(np.int16) | (high << 4)
        codes = u - offset(t)
        return codes.astype(np.int8 if t.code.dtype.signed else np.uint8).reshape(n, k)

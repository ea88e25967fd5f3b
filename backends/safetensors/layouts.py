"""compressed-tensors ``pack-quantized`` code layout (dense bit packing, compressed-tensors >= 0.17).

A signed code ``q`` in ``[-2^(b-1), 2^(b-1)-1]`` is stored as ``u = q + 2^(b-1)``; element ``j`` of a
row occupies bits ``[j*b, j*b+b)`` of the row's little-endian bit stream, least significant bit
first in each int32 word (4-bit: word ``k`` holds elements ``8k..8k+7``, element ``8k`` in bits 0-3).
The codes blob is ``i32[N, ceil(K*b/32)]``. For 3/5/6/7 bits, compressed-tensors <= 0.16 padded each
word instead (a different layout under the same format name), so this is version 1 of our layout:
the dense packing.
"""

from __future__ import annotations

import numpy as np

from qcompiler.ir.dtypes import DTYPES, DType
from qcompiler.ir.layouts import Layout
from qcompiler.ir.types import QuantType


def words_per_row(k: int, bits: int) -> int:
    return -(-k * bits // 32)


WIDE = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
"""Codes per byte -> the unsigned integer as wide as that many bytes."""


def spread_bytes(raw: np.ndarray, bits: int) -> np.ndarray:
    """``uint8[n, m]`` bytes of ``8 // bits`` fields each (LSB first; ``bits`` 1, 2, 4 or 8) -> the
    fields' signed codes, one per byte, ``int8[n, m * (8 // bits)]``: each byte widened to an
    integer of ``8 // bits`` bytes, field ``j`` shifted into byte ``j``, then the offset taken off
    every byte at once (wrapping: ``u - 2^(b-1)`` in two's complement). About 2.3x a table lookup."""
    per = 8 // bits
    wide = raw.astype(WIDE[per])
    mask = (1 << bits) - 1
    out = wide & mask
    for j in range(1, per):
        out |= (wide & (mask << (j * bits))) << (j * (8 - bits))
    u = out.view(np.uint8).reshape(raw.shape[0], -1)
    u -= np.uint8(1 << (bits - 1))
    return u.view(np.int8)


ROW_BLOCK = 1 << 20
"""Codes (un)packed at a time: rows are independent, and the temporaries stay a few MB."""


def row_steps(n: int, k: int) -> range:
    return range(0, n, max(1, ROW_BLOCK // max(k, 1)))


def pack_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """Signed ``[n, k]`` codes -> ``i32[n, ceil(k*bits/32)]`` (offset binary, LSB first, dense)."""
    n, k = codes.shape
    steps = row_steps(n, k)
    if len(steps) <= 1:
        return _pack_block(codes, bits)
    out = np.empty((n, words_per_row(k, bits)), dtype=np.int32)
    for r0 in steps:
        out[r0 : r0 + steps.step] = _pack_block(codes[r0 : r0 + steps.step], bits)
    return out


def gather_bytes(codes: np.ndarray, bits: int) -> np.ndarray:
    """``spread_bytes`` undone: C-contiguous ``int8[n, k]`` codes (``k`` a multiple of ``8 // bits``)
    -> ``uint8[n, k // (8 // bits)]``, each byte its ``8 // bits`` fields, least significant first.
    The offset is added to every byte at once (wrapping), each ``8 // bits`` bytes are read as one
    wide integer and every field is shifted down into place (a value outside the alphabet loses its
    high bits: the round trip that proves a packing refuses it)."""
    per = 8 // bits
    u = codes.view(np.uint8) + np.uint8(1 << (bits - 1))
    wide = u.reshape(codes.shape[0], -1).view(WIDE[per])
    mask = (1 << bits) - 1
    out = wide & mask
    for j in range(1, per):
        out |= (wide >> (j * (8 - bits))) & (mask << (j * bits))
    return out.astype(np.uint8)


def _pack_block(codes: np.ndarray, bits: int) -> np.ndarray:
    n, k = codes.shape
    per = 8 // bits if 8 % bits == 0 else 0
    if per and k % per == 0 and codes.dtype == np.int8:  # whole bytes: each is its codes shifted into place
        packed_bytes = np.zeros((n, words_per_row(k, bits) * 4), dtype=np.uint8)
        packed_bytes[:, : k // per] = gather_bytes(np.ascontiguousarray(codes), bits)
        return packed_bytes.view("<u4").view(np.int32).reshape(n, -1)
    u = (codes.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)
    stream = np.unpackbits(u[..., None], axis=-1, bitorder="little")[..., :bits].reshape(n, k * bits)
    width = words_per_row(k, bits) * 32
    stream = np.pad(stream, ((0, 0), (0, width - k * bits)))
    packed = np.packbits(stream, axis=-1, bitorder="little")
    return packed.view("<u4").view(np.int32).reshape(n, width // 32)


def unpack_rows(blob: np.ndarray, bits: int, n: int, k: int) -> np.ndarray:
    """``i32[n, ceil(k*bits/32)]`` -> signed ``i8[n, k]`` codes (padding bits ignored)."""
    steps = row_steps(n, k)
    if len(steps) <= 1:
        return _unpack_block(blob, bits, n, k)
    out = np.empty((n, k), dtype=np.int8)
    for r0 in steps:
        r1 = min(n, r0 + steps.step)
        out[r0:r1] = _unpack_block(blob[r0:r1], bits, r1 - r0, k)
    return out


def _unpack_block(blob: np.ndarray, bits: int, n: int, k: int) -> np.ndarray:
    raw = np.ascontiguousarray(blob, dtype="<i4").view(np.uint8).reshape(n, -1)
    if 8 % bits == 0:  # fields never straddle a byte
        used = -(-k // (8 // bits))
        codes = spread_bytes(raw[:, :used], bits)
        return codes if codes.shape[1] == k else np.ascontiguousarray(codes[:, :k])
    stream = np.unpackbits(raw, axis=-1, bitorder="little")[:, : k * bits].reshape(n, k, bits)
    u = np.packbits(stream, axis=-1, bitorder="little")[..., 0]
    return (u.astype(np.int16) - (1 << (bits - 1))).astype(np.int8)


def padding_bits_clear(blob: np.ndarray, bits: int, k: int) -> bool:
    """Whether the bits after the last code of every row are zero (as compressed-tensors writes them)."""
    n = blob.shape[0]
    for r0 in row_steps(n, k):
        rows = blob[r0 : r0 + max(1, ROW_BLOCK // max(k, 1))]
        raw = np.ascontiguousarray(rows, dtype="<i4").view(np.uint8).reshape(rows.shape[0], -1)
        first = k * bits // 8  # the bytes before it hold codes only
        if np.unpackbits(raw[:, first:], axis=-1, bitorder="little")[:, k * bits - 8 * first :].any():
            return False
    return True


def pack_dim0(values: np.ndarray, bits: int) -> np.ndarray:
    """compressed-tensors ``weight_zero_point``: signed ``[n, g]`` -> ``i32[ceil(n*bits/32), g]``,
    packed along dim 0 (each column is one bit stream)."""
    return np.ascontiguousarray(pack_rows(values.T, bits).T)


def unpack_dim0(blob: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of ``pack_dim0``: ``i32[ceil(n*bits/32), g]`` -> signed ``i8[n, g]``."""
    g = blob.shape[1]
    return np.ascontiguousarray(unpack_rows(np.ascontiguousarray(blob.T), bits, g, n).T)


class CtPackQuantized(Layout, family="ct-pack-quantized", version=1):
    """compressed-tensors ``weight_packed``: offset-binary codes, LSB-first, dense across int32 words."""

    encodings = ("offset-binary-lsb",)
    fields_in_range = True

    @classmethod
    def row_axis(cls, t: QuantType) -> int | None:
        return 0

    @classmethod
    def physical(cls, t: QuantType) -> tuple[DType, tuple[int, ...]]:
        n, k = (int(d) for d in t.shape)
        return DTYPES["i32"], (n, words_per_row(k, t.code.dtype.bits))

    @classmethod
    def pack(cls, codes: np.ndarray, t: QuantType) -> np.ndarray:
        if not t.code.dtype.signed:
            raise TypeError("ct-pack-quantized stores signed codes (offset binary)")
        return pack_rows(codes, t.code.dtype.bits)

    @classmethod
    def unpack(cls, blob: np.ndarray, t: QuantType) -> np.ndarray:
        n, k = (int(d) for d in t.shape)
        return unpack_rows(blob, t.code.dtype.bits, n, k)


class CtFloat8(Layout, family="ct-float8", version=1):
    """compressed-tensors ``float-quantized`` ``weight``: one FP8 E4M3FN value per element, ``[N, K]``,
    its bytes the logical codes (the bit patterns), declared ``f8e4m3`` so the container says ``F8_E4M3``."""

    encodings = ("e4m3fn",)

    @classmethod
    def row_axis(cls, t: QuantType) -> int | None:
        return 0

    @classmethod
    def physical(cls, t: QuantType) -> tuple[DType, tuple[int, ...]]:
        return DTYPES["f8e4m3"], tuple(int(d) for d in t.shape)

    @classmethod
    def pack(cls, codes: np.ndarray, t: QuantType) -> np.ndarray:
        if t.family != "f8e4m3":
            raise TypeError("ct-float8 stores float8 E4M3 codes only")
        return np.ascontiguousarray(codes, dtype=np.uint8).copy()

    @classmethod
    def unpack(cls, blob: np.ndarray, t: QuantType) -> np.ndarray:
        return np.ascontiguousarray(blob, dtype=np.uint8).copy()

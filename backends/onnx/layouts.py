"""The ONNX targets' code layouts. Both keep every code; only their order and packing differ.

- ``onnx-kn`` v1 ``transpose``: ``i8 [K, N]``, the codes transposed: the ``DequantizeLinear`` weight
  (``axis=0``, int4/int8).
- ``ort-nbits`` v1 ``b2``/``b4``/``b8``: ``u8 [N, K * bits / 8]``, ``code + 2^(bits-1)`` in
  little-endian fields along K: ``MatMulNBits``' input ``B`` (seen as ``[N, K / block, block * bits / 8]``).

MatMulNBits reads unsigned codes against a zero point that defaults to ``2^(bits-1)``, so a signed
code ``c`` is stored as ``c + 2^(bits-1)`` and (with no zero point given) decodes to ``c * scale``:
the same value. Element ``k`` of a row sits in byte ``k * bits // 8`` at bit ``(k * bits) % 8``.
"""

from __future__ import annotations

import numpy as np

from qcompiler.ir.dtypes import DTYPES, DType
from qcompiler.ir.layouts import Layout
from qcompiler.ir.types import QuantType

NBITS = {"b2": 2, "b4": 4, "b8": 8}


class OnnxKN(Layout, family="onnx-kn", version=1):
    """Codes transposed to ``[K, N]``, the orientation onnxruntime fuses into MatMulNBits."""

    encodings = ("transpose",)

    @classmethod
    def row_axis(cls, t: QuantType) -> int | None:
        return 1

    @classmethod
    def physical(cls, t: QuantType) -> tuple[DType, tuple[int, ...]]:
        n, k = (int(d) for d in t.shape)
        return t.code.dtype.container, (k, n)

    @classmethod
    def pack(cls, codes: np.ndarray, t: QuantType) -> np.ndarray:
        return np.ascontiguousarray(codes.T)

    @classmethod
    def unpack(cls, blob: np.ndarray, t: QuantType) -> np.ndarray:
        return np.ascontiguousarray(blob.T)


def pack_fields(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned ``values [rows, cols]`` (each < 2^bits) -> bytes ``[rows, cols * bits / 8]``, low bits first."""
    rows, cols = values.shape
    per = 8 // bits
    v = values.astype(np.uint8).reshape(rows, cols // per, per)
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    return np.bitwise_or.reduce(v << shifts, axis=2).astype(np.uint8)


def unpack_fields(raw: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """The inverse of ``pack_fields``: ``[rows, cols]`` unsigned values."""
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    mask = np.uint8((1 << bits) - 1)
    out = (raw[:, :, None] >> shifts) & mask
    return out.reshape(raw.shape[0], -1)[:, :cols]


class OrtNBits(Layout, family="ort-nbits", version=1):
    """``MatMulNBits``' ``B`` bytes (see the module docstring)."""

    encodings = tuple(NBITS)

    @classmethod
    def row_axis(cls, t: QuantType) -> int | None:
        return 0

    @classmethod
    def physical(cls, t: QuantType) -> tuple[DType, tuple[int, ...]]:
        n, k = (int(d) for d in t.shape)
        return DTYPES["u8"], (n, k * NBITS[t.pack.encoding] // 8)

    @classmethod
    def pack(cls, codes: np.ndarray, t: QuantType) -> np.ndarray:
        bits = NBITS[t.pack.encoding]
        return pack_fields(codes.astype(np.int16) + (1 << (bits - 1)), bits)

    @classmethod
    def unpack(cls, blob: np.ndarray, t: QuantType) -> np.ndarray:
        bits = NBITS[t.pack.encoding]
        k = int(t.shape[1])
        values = unpack_fields(np.asarray(blob, dtype=np.uint8), bits, k).astype(np.int16) - (1 << (bits - 1))
        return values.astype(t.code.dtype.container.numpy)

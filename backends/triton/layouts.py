"""The Triton kernels' code layout: ``triton-kn`` v1.

``u8 [K / per, N]`` with ``per = 8 / bits`` codes per byte: byte ``(kb, n)`` holds codes
``k = kb * per + j`` (``j = 0 .. per-1``) of output column ``n`` at bits ``bits * j``, each stored as
``code + offset`` (``offset = 2^(bits-1)`` for signed codes, 0 for unsigned). Encodings ``b2``, ``b4``,
``b8``; ``tile = [1, per]`` (``per`` codes of a row share a byte along K, logical axis 1; any N).

Why this layout (docs/kernels.md has the long form):

- N is contiguous, so a warp reading one K-row of a ``[BLOCK_K / per, BLOCK_N]`` tile reads
  ``BLOCK_N`` consecutive bytes: with ``BLOCK_N = 128`` that is eight 128-bit loads per row, fully
  coalesced, and the same bytes serve every row of the activation tile;
- packing along K keeps one output column's codes in one byte lane, so unpacking is one shift and
  one mask per code, with no cross-lane shuffles, and a K tile of a group's length reads one scale row;
- bytes, not 32-bit words: a tile edge only has to be a multiple of ``per`` (2 or 4), and 8-bit
  packing measured faster than 32-bit words in GemLite's Triton kernels.

Tensor-parallel slicing commutes with packing (``slice_packed``): along N (column parallel) for any
range; along K (row parallel) for ranges on multiples of ``per`` (every whole-group split is one).
"""

from __future__ import annotations

import numpy as np

from qcompiler.ir.dtypes import DTYPES, DType
from qcompiler.ir.layouts import Layout
from qcompiler.ir.types import QuantType

ENCODINGS = {"b2": 2, "b4": 4, "b8": 8}


def offset_of(t: QuantType) -> int:
    bits = t.code.dtype.bits
    return 1 << (bits - 1) if t.code.dtype.signed else 0


def pack_kn(codes: np.ndarray, bits: int, offset: int) -> np.ndarray:
    """Logical codes ``[N, K]`` -> ``u8 [K / per, N]`` (see the module docstring)."""
    per = 8 // bits
    n, k = codes.shape
    if k % per:
        raise ValueError(f"K={k} is not a multiple of {per} ({bits}-bit codes per byte)")
    fields = (codes.astype(np.int16) + offset).astype(np.uint8).T.reshape(k // per, per, n)
    shifts = (np.arange(per, dtype=np.uint8) * bits)[None, :, None]
    return np.bitwise_or.reduce(fields << shifts, axis=1).astype(np.uint8)


def unpack_kn(blob: np.ndarray, bits: int, offset: int, k: int) -> np.ndarray:
    """``u8 [K / per, N]`` -> codes ``[N, K]`` as int16 (the inverse of ``pack_kn``)."""
    per = 8 // bits
    raw = np.asarray(blob, dtype=np.uint8)
    shifts = (np.arange(per, dtype=np.uint8) * bits)[None, :, None]
    fields = (raw[:, None, :] >> shifts) & np.uint8((1 << bits) - 1)
    return fields.reshape(-1, raw.shape[1])[:k].T.astype(np.int16) - offset


def slice_packed(blob: np.ndarray, bits: int, dim: int, start: int, stop: int) -> np.ndarray:
    """``pack(W)`` sliced as ``W[start:stop]`` along logical ``dim`` (0: N, 1: K) would be; along K the
    bounds must be multiples of ``per`` (``ValueError`` otherwise: the layout does not commute there)."""
    if dim == 0:
        return np.ascontiguousarray(blob[:, start:stop])
    per = 8 // bits
    if start % per or stop % per:
        raise ValueError(f"triton-kn slices K only on multiples of {per}, not [{start}, {stop})")
    return np.ascontiguousarray(blob[start // per : stop // per])


class TritonKN(Layout, family="triton-kn", version=1):
    """See the module docstring."""

    encodings = tuple(ENCODINGS)

    @classmethod
    def row_axis(cls, t: QuantType) -> int | None:
        return 1

    @classmethod
    def physical(cls, t: QuantType) -> tuple[DType, tuple[int, ...]]:
        n, k = (int(d) for d in t.shape)
        return DTYPES["u8"], (k * ENCODINGS[t.pack.encoding] // 8, n)

    @classmethod
    def pack(cls, codes: np.ndarray, t: QuantType) -> np.ndarray:
        return pack_kn(codes, ENCODINGS[t.pack.encoding], offset_of(t))

    @classmethod
    def unpack(cls, blob: np.ndarray, t: QuantType) -> np.ndarray:
        bits = ENCODINGS[t.pack.encoding]
        codes = unpack_kn(blob, bits, offset_of(t), int(t.shape[1]))
        return codes.astype(t.code.dtype.container.numpy)

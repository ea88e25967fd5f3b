"""``npz-codes`` v1: one code per byte in the logical shape, the IR's logical codes as they are (so
``weights.npz`` shows them), declared under its own name because a published artifact's weights are
always in a target's layout, never in ``logical``."""

from __future__ import annotations

import numpy as np

from qcompiler.ir.dtypes import DType
from qcompiler.ir.layouts import Layout
from qcompiler.ir.types import QuantType


class NpzCodes(Layout, family="npz-codes", version=1):
    @classmethod
    def row_axis(cls, t: QuantType) -> int | None:
        return 0

    @classmethod
    def physical(cls, t: QuantType) -> tuple[DType, tuple[int, ...]]:
        return t.code.dtype.container, tuple(int(d) for d in t.shape)

    @classmethod
    def pack(cls, codes: np.ndarray, t: QuantType) -> np.ndarray:
        return np.ascontiguousarray(codes, dtype=np.dtype(t.code.dtype.container.numpy)).copy()

    @classmethod
    def unpack(cls, blob: np.ndarray, t: QuantType) -> np.ndarray:
        return np.ascontiguousarray(blob, dtype=np.dtype(t.code.dtype.container.numpy)).copy()

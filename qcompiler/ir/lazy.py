"""Large 2-D values of the reference interpreter kept unexpanded until an op needs them whole.

``embedding`` gathers only the rows it needs and ``linear`` computes a few MB of its weight's rows at
a time (at most ``BLOCK``); any other op gets ``whole()``. Two kinds: ``Lazy`` (``interpret``), a
stored dense constant and the casts applied to it, so an 8B model's bf16 head is never also held in
float32; and ``Decoded``, a huge quantized weight's reference decode computed a block of rows at a
time (``ir.row_blocks``), so the graph probe never holds a whole 128256 x 4096 decode (2.1 GB of
float32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


class LazyRows:
    """Rows of a 2-D value on demand, then the casts applied to it, in order."""

    BLOCK = 4096
    casts: tuple[torch.dtype, ...]

    @property
    def rows_count(self) -> int:
        raise NotImplementedError

    def fetch(self, index: Any) -> torch.Tensor:
        """The rows ``index`` (a slice or an array of row numbers) before the casts."""
        raise NotImplementedError

    def rows(self, index: Any) -> torch.Tensor:
        t = self.fetch(index)
        for dtype in self.casts:
            t = t.to(dtype)
        return t

    def whole(self) -> torch.Tensor:
        return self.rows(slice(None))

    def cast(self, dtype: torch.dtype) -> LazyRows:
        return dataclasses.replace(self, casts=(*self.casts, dtype))  # pyright: ignore[reportArgumentType]


@dataclass(frozen=True)
class Decoded(LazyRows):
    """The float32 reference decode of a quantized weight of ``shape``: ``decode_rows(r0, r1)`` gives
    rows ``[r0, r1)``; gathered rows are decoded ``block_rows`` at a time, only where asked for."""

    shape: tuple[int, int]
    decode_rows: Callable[[int, int], np.ndarray]
    block_rows: int
    casts: tuple[torch.dtype, ...] = ()

    @property
    def rows_count(self) -> int:
        return self.shape[0]

    def fetch(self, index: Any) -> torch.Tensor:
        if isinstance(index, slice):
            r0, r1, step = index.indices(self.shape[0])
            rows = self.decode_rows(r0, max(r0, r1))
            return torch.from_numpy(np.ascontiguousarray(rows if step == 1 else rows[::step]))
        ids = np.asarray(index, dtype=np.int64).reshape(-1)
        out = np.empty((ids.size, self.shape[1]), dtype=np.float32)
        for b0 in range(0, self.shape[0], self.block_rows):
            b1 = min(self.shape[0], b0 + self.block_rows)
            sel = np.flatnonzero((ids >= b0) & (ids < b1))
            if sel.size:
                out[sel] = self.decode_rows(b0, b1)[ids[sel] - b0]
        return torch.from_numpy(out)

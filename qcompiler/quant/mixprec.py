"""Intra-weight mixed 2/4/16-bit quantization: the logical arrays, their rate and their float decode.

A weight ``W`` (float ``[N, K]``, out x in) is cut into groups of ``G`` along K, flat index
``gi = r * (K // G) + g``. Each group is 2-bit or 4-bit: ``wide_rows`` lists the rows whose groups
are all 4-bit, ``wide`` the other 4-bit groups (both sorted; a row entry costs what a group entry
does, so a whole 4-bit row or weight costs almost no map).
First-level scales ``s1 [N, K // G]`` are quantized again (8-bit affine, grouped along the output
axis in blocks of ``G2`` rows, the last block may be short)::

    s1[r, g] = float32(float32(scale_codes[r, g]) - float32(zero2[r // G2, g])) * float32(scale2[r // G2, g])
    w[r, k]  = float32(float32(codes[r, k]) - float32(zero[r, g])) * s1[r, g]        g = k // G

and a few 16-bit outliers (CSR by row, only inside 2-bit groups) replace their element:
``w[r, col] = float32(value)``; the code there equals the group's zero point. ``quantize_mixed``
(and the cross-weight allocators) live in ``qcompiler.quant.mixprec_alloc``; the group fitting in
``qcompiler.quant.mixprec_fit``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from qcompiler.errors import QcError

Array = NDArray[np.generic]


class MixedQuantError(QcError):
    """A weight, a Hessian, a budget or a set of arrays breaks a rule of the mixed representation.

    ``str(e)`` reads ``FIELD: message (expected E, found F)``.
    """

    def __init__(self, message: str, *, field: str, expected: object, found: object) -> None:
        self.message, self.field, self.expected, self.found = message, field, expected, found
        super().__init__(f"{field}: {message} (expected {expected}, found {found})")


def index_dtype(limit: int) -> type[np.int16] | type[np.int32]:
    """int16 when every index is below ``limit <= 32767``, else int32."""
    return np.int16 if limit <= 32767 else np.int32


def rate_bits(n: int, k: int, group: int, group2: int, n4: int, nnz: int, rows4: int = 0) -> int:
    """All-in bits of one weight with ``n4`` 4-bit groups, ``rows4`` of whose rows are all 4-bit:
    codes + qparams + exceptions.

    codes ``2 N K + 2 G n4``; per group an 8-bit zero and an 8-bit scale code; per second-level
    entry a 16-bit ``scale2`` and an 8-bit ``zero2``; the map at 16 or 32 bits an entry, one per
    listed row (``wide_rows``) and one per other 4-bit group (``wide``); ``rowptr`` 16 bits (32 when
    ``nnz > 32767``) times ``N + 1``; per outlier its column (16 or 32 bits) and a 16-bit value.
    """
    groups = n * (k // group)
    second = -(-n // group2) * (k // group)
    wide_bits = 16 if groups <= 32767 else 32
    row_bits = 16 if n <= 32767 else 32
    col_bits = 16 if k <= 32767 else 32
    codes = 2 * n * k + 2 * group * n4
    listed = wide_bits * (n4 - rows4 * (k // group)) + row_bits * rows4
    rowptr_bits = 16 if nnz <= 32767 else 32
    return codes + 16 * groups + 24 * second + listed + rowptr_bits * (n + 1) + (col_bits + 16) * nnz


def bits_per_weight(n: int, k: int, group: int, group2: int, n4: int, nnz: int) -> float:
    """``rate_bits`` over the ``N K`` weights."""
    return rate_bits(n, k, group, group2, n4, nnz) / (n * k)


def uniform_rate_bits(n: int, k: int, group: int, group2: int, bits: int) -> int:
    """Bits of a weight stored uniform (every group ``bits`` wide, no ``wide`` list, no outlier CSR)."""
    groups = n * (k // group)
    return bits * n * k + 16 * groups + 24 * -(-n // group2) * (k // group)


@dataclass(frozen=True, eq=False)
class MixedQuant:
    """One weight in the mixed representation (numpy arrays; compared by identity)."""

    codes: NDArray[np.uint8]
    zero: NDArray[np.uint8]
    scale_codes: NDArray[np.uint8]
    scale2: NDArray[np.float16]
    zero2: NDArray[np.uint8]
    wide: NDArray[np.integer]
    wide_rows: NDArray[np.integer]
    rowptr: NDArray[np.integer]
    col: NDArray[np.integer]
    value: NDArray[np.float16]
    group: int
    group2: int

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``."""
        n, k = self.codes.shape
        return int(n), int(k)

    @property
    def n4(self) -> int:
        """How many groups are 4-bit (those of ``wide_rows`` and those of ``wide``)."""
        _, k = self.shape
        return int(self.wide.shape[0]) + int(self.wide_rows.shape[0]) * (k // self.group)

    @property
    def nnz(self) -> int:
        """How many 16-bit outliers."""
        return int(self.value.shape[0])

    def rate_bits(self) -> int:
        """All-in bits (``rate_bits`` of this weight's sizes)."""
        n, k = self.shape
        return rate_bits(n, k, self.group, self.group2, self.n4, self.nnz, int(self.wide_rows.shape[0]))

    def bits_per_weight(self) -> float:
        """All-in bits per weight."""
        n, k = self.shape
        return self.rate_bits() / (n * k)

    def scales(self) -> NDArray[np.float32]:
        """Decoded first-level scales ``s1``, float32 ``[N, K // G]``."""
        rows = np.arange(self.codes.shape[0]) // self.group2
        q = self.scale_codes.astype(np.float32) - self.zero2[rows].astype(np.float32)
        return (q * self.scale2[rows].astype(np.float32)).astype(np.float32)

    def decode(self) -> NDArray[np.float32]:
        """The float32 weight ``[N, K]``: the affine part, then the outliers replace their elements."""
        n, k = self.shape
        ng = k // self.group
        diff = self.codes.astype(np.float32).reshape(n, ng, self.group) - self.zero.astype(np.float32)[:, :, None]
        w = (diff * self.scales()[:, :, None]).reshape(n, k).astype(np.float32)
        rows = np.repeat(np.arange(n), np.diff(self.rowptr.astype(np.int64)))
        w[rows, self.col.astype(np.int64)] = self.value.astype(np.float32)
        return w

    def group_bits(self) -> NDArray[np.int64]:
        """Each group's width (2 or 4), int64 ``[N, K // G]``."""
        n, k = self.shape
        bits = np.full(n * (k // self.group), 2, dtype=np.int64)
        bits[self.wide.astype(np.int64)] = 4
        bits = bits.reshape(n, k // self.group)
        bits[self.wide_rows.astype(np.int64)] = 4
        return bits


def check_weight(w: object, group: int, group2: int) -> NDArray[np.float64]:
    """The weight as float64 numpy ``[N, K]``, or a ``MixedQuantError`` naming what is wrong."""
    import torch

    if not isinstance(w, torch.Tensor):
        raise MixedQuantError("must be a torch.Tensor", field="w", expected="torch.Tensor", found=type(w).__name__)
    if w.dim() != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise MixedQuantError(
            "must be a non-empty 2-D [N, K] tensor", field="w.shape", expected="[N, K]", found=list(w.shape)
        )
    if not w.dtype.is_floating_point:
        raise MixedQuantError("must be floating point", field="w.dtype", expected="a float dtype", found=w.dtype)
    if group <= 0 or group % 16 != 0:
        raise MixedQuantError("must be a positive multiple of 16", field="group", expected="G % 16 == 0", found=group)
    if group2 <= 0:
        raise MixedQuantError("must be positive", field="group2", expected="G2 >= 1", found=group2)
    k = int(w.shape[1])
    if k % group != 0:
        raise MixedQuantError(
            "K must be a multiple of the group size", field="w.shape[1]", expected=f"K % {group} == 0", found=k
        )
    x = w.detach().to(torch.float64).cpu().numpy()
    bad = np.argwhere(~np.isfinite(x))
    if bad.shape[0] > 0:
        r, c = (int(i) for i in bad[0])
        raise MixedQuantError(
            "every value must be finite", field=f"w[{r}, {c}]", expected="a finite value", found=x[r, c]
        )
    peak = float(np.abs(x).max())
    if peak > 1.0e6:
        raise MixedQuantError("too large for float16 second-level scales", field="w", expected="|w| <= 1e6", found=peak)
    return x


def check_hessian(h: object, k: int) -> NDArray[np.float64] | None:
    """A diagonal ``[K]`` or full ``[K, K]`` Hessian as float64 numpy (``None`` passes through)."""
    import torch

    if h is None:
        return None
    if not isinstance(h, torch.Tensor):
        raise MixedQuantError(
            "must be a torch.Tensor", field="hessian", expected="torch.Tensor", found=type(h).__name__
        )
    if tuple(h.shape) not in ((k,), (k, k)):
        raise MixedQuantError(
            "must match the weight's K", field="hessian.shape", expected=f"[{k}] or [{k}, {k}]", found=list(h.shape)
        )
    x = h.detach().to(torch.float64).cpu().numpy()
    diag = x if x.ndim == 1 else np.diagonal(x)
    if not bool(np.isfinite(x).all()) or bool((diag < 0).any()):
        raise MixedQuantError(
            "must be finite with a non-negative diagonal", field="hessian", expected="finite, diag >= 0", found="not"
        )
    return x

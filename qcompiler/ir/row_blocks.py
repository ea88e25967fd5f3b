"""Row blocks of a 2-D quantized weight: the same descriptor and parts for rows ``[r0, r1)`` only.

The reference decoders are elementwise once qparams are bound, and a weight grouped along its last
axis (or not grouped) keeps every qparam of row ``r`` in row ``r`` of the qparam (or in the one
per-tensor entry), so decoding rows ``[r0, r1)`` of it gives rows ``[r0, r1)`` of the whole decode,
bit for bit. The checks that stream a weight (the parity ladder, the freeze proof of ggml blocks)
decode a huge weight (a 128256-row embedding) a block of rows at a time: memory follows the block,
not the weight.

A weight is row-sliceable when it is 2-D, of a family whose decode is elementwise (``affine``,
``ternary``, ``nested``, ``f8e4m3``; not ``mixed``, whose exception indices are flat), without exceptions or
transforms, grouped along axis 1 (or not at all), every qparam (nested ones too) sliceable in turn
with ``N`` or one row, and its codes' layout names the physical axis logical rows lie along
(``Layout.row_axis``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from qcompiler.ir.descriptor import rate_claim
from qcompiler.ir.layouts import find_layout, logical_view
from qcompiler.ir.reference import decode
from qcompiler.ir.types import DenseType, PackSpec, QuantType

BLOCK_ELEMENTS = 1 << 23
"""Elements decoded at a time (8M: 32 MB of float32), unless a single row is longer."""

ROWWISE = frozenset({"affine", "ternary", "nested", "f8e4m3"})
"""Families whose reference decode is elementwise given the bound qparams."""


def rows_of(t: QuantType) -> int:
    return int(t.shape[0])


def sliceable(t: QuantType, physical: bool = True) -> bool:
    """Whether ``t``'s decode may be computed a block of rows at a time (see the module docstring);
    ``physical``: its codes' layout must also slice by rows (a nested qparam's codes are logical)."""
    if t.rank != 2 or t.family not in ROWWISE or t.exceptions or t.transforms or not static(t.shape):
        return False
    if t.group is not None and t.group.axis != 1:
        return False
    if physical and row_axis(t) is None:
        return False
    n = rows_of(t)
    for _, slot in t.qparams:
        if slot.rank != 2 or not static(slot.shape) or int(slot.shape[0]) not in (n, 1):
            return False
        if isinstance(slot, QuantType) and (int(slot.shape[0]) != n or not sliceable(slot, physical=False)):
            return False
    return True


def static(shape: tuple[object, ...]) -> bool:
    return all(isinstance(d, int) for d in shape)


def row_axis(t: QuantType) -> int | None:
    layout = find_layout(t.pack.family, t.pack.version)
    return None if layout is None else layout.row_axis(t)


def blocks(t: QuantType, budget: int | None = None) -> Iterator[tuple[int, int]]:
    """``(r0, r1)`` covering every row, about ``budget`` (default ``BLOCK_ELEMENTS``) elements each,
    at least one row."""
    n, k = (int(d) for d in t.shape)
    budget = budget or BLOCK_ELEMENTS
    step = max(1, budget // max(k, 1))
    for r0 in range(0, n, step):
        yield r0, min(n, r0 + step)


def huge(t: QuantType, budget: int | None = None) -> bool:
    """Worth slicing: more than one block, and sliceable."""
    size = int(t.shape[0]) * int(t.shape[1]) if t.rank == 2 and static(t.shape) else 0
    return size > (budget or BLOCK_ELEMENTS) and sliceable(t)


def slice_type(t: QuantType, r0: int, r1: int) -> QuantType:
    """``t`` for rows ``[r0, r1)``: the expressed shape and every qparam of ``N`` rows cut to ``r1 - r0``
    (a whole-tensor rate claim restated for those rows)."""
    n = rows_of(t)
    qparams: list[tuple[str, DenseType | QuantType]] = []
    for name, slot in t.qparams:
        if int(slot.shape[0]) != n or n == 1:
            qparams.append((name, slot))
        elif isinstance(slot, QuantType):
            qparams.append((name, slice_type(slot, r0, r1)))
        else:
            qparams.append((name, dataclasses.replace(slot, shape=(r1 - r0, *slot.shape[1:]))))
    expressed = dataclasses.replace(t.expressed, shape=(r1 - r0, *t.expressed.shape[1:]))
    out = dataclasses.replace(t, expressed=expressed, qparams=tuple(qparams))
    r = t.rate
    if r is not None and r.scope == "tensor":  # a whole-tensor claim counts the block's rows now
        out = dataclasses.replace(out, rate=rate_claim(out, r.incl, r.unit, r.scope))
    return out


def slice_codes(codes: np.ndarray, t: QuantType, r0: int, r1: int) -> np.ndarray:
    """The physical codes blob of ``t`` cut to rows ``[r0, r1)`` (contiguous)."""
    axis = row_axis(t)
    if axis is None:
        raise TypeError(f"layout {t.pack.family} v{t.pack.version} does not slice by rows")
    index = tuple(slice(r0, r1) if d == axis else slice(None) for d in range(codes.ndim))
    return np.ascontiguousarray(codes[index])


def slice_parts(t: QuantType, parts: Mapping[str, Any], r0: int, r1: int, *, codes: bool = True) -> dict[str, Any]:
    """``parts`` of ``t`` cut to rows ``[r0, r1)``: the codes (in ``t``'s layout, unless ``codes`` is
    false: then they are left out), every qparam of ``N`` rows (nested ones recursively); ``perm``
    (along K) is kept whole."""
    n = rows_of(t)
    slots = dict(t.qparams)
    out: dict[str, Any] = {}
    for name, value in parts.items():
        slot = slots.get(name)
        if name == "codes":
            if codes:
                out[name] = slice_codes(value, t, r0, r1)
        elif slot is None or int(slot.shape[0]) != n or n == 1:
            out[name] = value
        elif isinstance(slot, QuantType):
            out[name] = slice_parts(slot, value, r0, r1)
        else:
            out[name] = value[r0:r1]
    return out


def decoded_rows(
    bound: Mapping[str, Any], t: QuantType, r0: int, r1: int, logical: np.ndarray | None = None
) -> np.ndarray:
    """Rows ``[r0, r1)`` of the reference decode of a weight whose parts are ``bound`` (codes in
    ``t``'s layout); ``logical``: those rows' codes already unpacked."""
    st = slice_type(t, r0, r1)
    p = slice_parts(t, bound, r0, r1, codes=logical is None)
    if logical is None:
        p["codes"], lt = logical_view(p["codes"], st, p)
    else:
        p["codes"], lt = logical, dataclasses.replace(st, pack=PackSpec())
    return np.asarray(decode(lt, p), dtype=np.float32)

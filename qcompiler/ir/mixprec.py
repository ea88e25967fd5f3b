"""``mixprec``: one weight whose groups are 2-bit or 4-bit, with nested scales and sparse outliers.

The representation of arXiv 2311.16442 ("2/4/16-bit in a weight matrix"). For a weight ``[N, K]``
(out x in) with groups of ``G`` along ``K`` (axis 1), every part is a named stream::

    !q.mixprec<u4[0:15] -> f32[64,256], unit=element, rev=1, group=(axis=1, size=64, tail=partial),
      qparams={scale: !q.affine<u8[0:255] -> f32[64,4], ..., group=(axis=0, size=32, tail=partial),
                 qparams={scale: f16[2,4], zero: u8[2,4]}, ..., req=qparam>,
               zero: u8[64,4]},
      exceptions={col: i16[9], rowptr: i32[65], value: f16[9], wide: i16[40], wide_rows: i16[2]},
      decoder=1, pack=(family=mixprec, version=1, encoding=planes-a16, tile=[1,1]), req=linear>

- precision map, two lists (each strictly increasing, i16 or i32): ``wide_rows``, the rows whose every
  group is 4-bit (16 or 32 bits a row, whatever K), and ``wide``, the flat indices ``r * (K/G) + g`` of
  the other 4-bit groups (16 or 32 bits a group). Canonical: a row whose groups are all 4-bit is in
  ``wide_rows``, never spelled out in ``wide``. Every other group is 2-bit. Both lengths are in the
  type, so the rate follows from the descriptor.
- codes: unsigned, ``[0:3]`` in a 2-bit group, ``[0:15]`` in a 4-bit one (contract ``u4[0:15]``).
- first level: ``zero`` (``u8``, within the group's width) and ``scale``, itself quantized by a second
  level affine quantizer grouped along the *output* axis (``!q.affine``, ``req=qparam``), or dense.
- outliers: CSR by row, ``rowptr`` (``i32[N+1]``, or ``i16[N+1]`` when the outlier count is at most
  32767), ``col`` (strictly increasing in a row), ``value`` (a float). Exclusive: only inside 2-bit
  groups, and the code there equals the group's zero point, so the affine part is exactly 0 and
  *replacement* (``w[r, col] = value``) equals *correction*.

Decoder 1: ``s1 = decode(scale)`` (second level first), ``w = float32(code - zero) * float32(s1)``
per group, then the outliers replace their elements; the cast to the expressed dtype comes last.
The seed's worked example: ``q_s=5, z2=1, s2=0.25 -> s1=1``; ``q_w=3, z1=2 -> w=1``.

Packed layout ``mixprec`` v1, encoding ``planes-a16`` (``PlanesLayout``): one ``u8`` blob, the low
plane (bits 0-1 of every code, row-major, four codes per byte, first code in the lowest bits) padded
with zero bytes to a multiple of 16, then the high plane (bits 2-3 of the codes of the 4-bit groups
only, in flat group order, ``G/4`` bytes per group) padded the same way. A reordered group, a dropped
pad or a pad that is not zero is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from qcompiler.ir.dtypes import DTYPES, DType
from qcompiler.ir.families import Family, Problem
from qcompiler.ir.layouts import Layout, LayoutError
from qcompiler.ir.types import DenseType, QuantType, format_shape, is_dynamic

WIDTHS = (2, 4)
"""Code widths a group may have."""
EXCEPTION_SEMANTICS = "replacement"
ALIGN = 16
"""Each plane of the packed blob starts and ends on a multiple of this many bytes."""
INDEX_DTYPES = ("i16", "i32")


def pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def dims(t: QuantType) -> tuple[int, int, int]:
    """``N, K, G`` of a static ``mixprec`` descriptor."""
    assert t.group is not None
    return int(t.shape[0]), int(t.shape[1]), t.group.size


def wide_count(t: QuantType) -> int:
    """How many groups are 4-bit: the listed groups plus every group of the listed rows."""
    slots = dict(t.exceptions)
    _, k, g = dims(t)
    return int(slots["wide"].shape[0]) + int(slots["wide_rows"].shape[0]) * (k // g)


def four_bit(n: int, groups_per_row: int, wide: np.ndarray, wide_rows: np.ndarray) -> np.ndarray:
    """The flat indices of every 4-bit group, sorted: the groups of ``wide_rows`` and ``wide``."""
    rows = wide_rows.astype(np.int64)
    full = (rows[:, None] * groups_per_row + np.arange(groups_per_row)[None, :]).reshape(-1)
    return np.union1d(full, wide.astype(np.int64))


class Mixprec(Family, name="mixprec"):
    """2-bit and 4-bit groups by a precision map, nested first-level scales, exclusive outliers."""

    required = ("scale", "zero")
    exceptions = ("col", "rowptr", "value", "wide", "wide_rows")
    nested = True

    @classmethod
    def code_bits(cls, t: QuantType) -> int | None:
        """Bits the codes store: two per element, two more per element of a 4-bit group."""
        n, k, g = dims(t)
        return 2 * n * k + 2 * g * wide_count(t)

    @classmethod
    def check(cls, t: QuantType) -> Problem | None:
        for rule in (_shape_rule, _code_rule, _qparam_rule, _exception_rule):
            if (problem := rule(t)) is not None:
                return problem
        return None


def _shape_rule(t: QuantType) -> Problem | None:
    if t.rank != 2 or t.group is None or t.group.axis != 1:
        return Problem("group", "mixprec groups a rank-2 [N, K] weight along K", "rank 2, axis=1", str(t.group))
    if any(is_dynamic(d) for d in t.shape):
        return Problem("expressed", "mixprec needs static dims", "static dims", t.expressed.short())
    _, k, g = dims(t)
    if g % 16 != 0 or k % g != 0:
        return Problem("group", "group size must be a multiple of 16 that divides K", f"G | {k}, 16 | G", str(g))
    if t.perm is not None or t.transforms:
        return Problem("perm", "mixprec has no permutation or transform", "none", "present")
    return None


def _code_rule(t: QuantType) -> Problem | None:
    c = t.code
    if c.dtype.name != "u4" or c.alphabet.values is not None or (c.alphabet.lo, c.alphabet.hi) != (0, 15):
        return Problem("code", "mixprec codes are unsigned, at most 4 bits", "u4[0:15]", c.head())
    return None


def _qparam_rule(t: QuantType) -> Problem | None:
    zero, scale = t.qparam("zero"), t.qparam("scale")
    if not isinstance(zero, DenseType) or zero.dtype.name != "u8":
        found = zero.short() if zero is not None else "none"
        return Problem("qparams", "mixprec zero points are dense u8", "u8[N,K/G]", found)
    if isinstance(scale, DenseType):
        ok = scale.dtype.is_float
        return None if ok else Problem("qparams", "a dense scale is a float", "a float dtype", scale.dtype.name)
    if scale is None or scale.family != "affine" or scale.req != "qparam":
        found = "none" if scale is None else f"{scale.family}, req={scale.req}"
        return Problem("qparams", "a quantized scale is a second-level affine qparam", "affine, req=qparam", found)
    if scale.group is None or scale.group.axis != 0:
        return Problem("qparams", "second-level groups run along the output axis", "axis=0", str(scale.group))
    return None


def _exception_rule(t: QuantType) -> Problem | None:
    n, _, _ = dims(t)
    s = {name: slot for name, slot in t.exceptions if isinstance(slot, DenseType)}
    if len(s) != 5:
        return None  # missing or quantized slots are reported by the generic slot rules
    for name in ("wide", "wide_rows", "col"):
        if s[name].rank != 1 or s[name].dtype.name not in INDEX_DTYPES:
            return Problem("exceptions", f"'{name}' is a rank-1 i16 or i32 index", "i16[n] | i32[n]", s[name].short())
    rows = s["wide_rows"].shape[0]
    if isinstance(rows, int) and rows > n:
        return Problem(
            "exceptions", "'wide_rows' lists each row at most once", f"at most {n} rows", s["wide_rows"].short()
        )
    rowptr, value, col = s["rowptr"], s["value"], s["col"]
    if rowptr.dtype.name not in INDEX_DTYPES or rowptr.rank != 1 or rowptr.shape[0] != n + 1:
        want = f"i16[{n + 1}] | i32[{n + 1}]"
        return Problem("exceptions", "'rowptr' has one entry per row plus one", want, rowptr.short())
    count = col.shape[0] if col.rank == 1 else None
    if rowptr.dtype.name == "i16" and isinstance(count, int) and count > 32767:
        return Problem("exceptions", "an i16 'rowptr' counts at most 32767 outliers", "i32 rowptr", rowptr.short())
    if not value.dtype.is_float or value.rank != 1 or value.shape != col.shape:
        want = f"a float[{format_shape(col.shape)[1:-1]}]"
        return Problem("exceptions", "one float 'value' per outlier 'col'", want, value.short())
    return None


# --------------------------------------------------------------------------- rules that need bytes


def group_is_wide(t: QuantType, wide: np.ndarray, wide_rows: np.ndarray) -> np.ndarray:
    """``bool[N, K/G]``: which groups are 4-bit (the map already checked)."""
    n, k, g = dims(t)
    out = np.zeros(n * (k // g), dtype=bool)
    out[wide.astype(np.int64)] = True
    out = out.reshape(n, k // g)
    out[wide_rows.astype(np.int64)] = True
    return out


def map_problem(n: int, groups_per_row: int, wide: np.ndarray, wide_rows: np.ndarray) -> Problem | None:
    """The precision map's own rules: both lists in bounds and strictly increasing, no group of a
    listed row in ``wide``, and no row spelled out whole in ``wide`` (the canonical form). The field
    names the first offending entry (``wide_rows[i]``, ``wide[i]``)."""
    rows, groups = wide_rows.astype(np.int64), wide.astype(np.int64)
    if (i := _first_bad(rows, n)) is not None:
        want = f"strictly increasing in [0, {n})"
        return Problem(f"wide_rows[{i}]", "4-bit rows strictly increasing inside the weight", want, str(int(rows[i])))
    total = n * groups_per_row
    if (i := _first_bad(groups, total)) is not None:
        want = f"strictly increasing in [0, {total})"
        return Problem(
            f"wide[{i}]", "4-bit group indices strictly increasing inside the map", want, str(int(groups[i]))
        )
    owner = groups // groups_per_row
    listed = np.isin(owner, rows)
    if listed.any():
        i = int(np.argwhere(listed)[0][0])
        return Problem(
            f"wide[{i}]", "a group of a row already in 'wide_rows'", "a group of another row", str(int(groups[i]))
        )
    whole = np.bincount(owner, minlength=n) == groups_per_row
    if whole.any():
        r = int(np.argwhere(whole)[0][0])
        i = int(np.argwhere(owner == r)[0][0])
        message = "a row whose groups are all 4-bit is listed in 'wide_rows'"
        return Problem(f"wide[{i}]", message, "in wide_rows", f"row {r} spelled out from group {int(groups[i])}")
    return None


def data_problem(t: QuantType, codes: np.ndarray, arrays: Mapping[str, np.ndarray]) -> Problem | None:
    """The cross-stream rules: the map is in bounds and sorted, codes and zeros fit their group's
    width, the CSR is well formed, and every outlier sits in a 2-bit group on a code equal to its zero."""
    n, k, g = dims(t)
    if (problem := map_problem(n, k // g, arrays["wide"], arrays["wide_rows"])) is not None:
        return problem
    is4 = group_is_wide(t, arrays["wide"], arrays["wide_rows"])
    limit = np.where(is4, 15, 3)
    over = codes.reshape(n, k // g, g).max(axis=2) > limit
    if over.any():
        r, gi = (int(i) for i in np.argwhere(over)[0])
        return Problem(
            f"codes[{r},{gi * g}:{(gi + 1) * g}]", "code wider than its group", "<= 3 in a 2-bit group", "a code > 3"
        )
    zero = arrays["zero"]
    if np.any(zero > limit):
        r, gi = (int(i) for i in np.argwhere(zero > limit)[0])
        return Problem(
            f"zero[{r},{gi}]", "zero point wider than its group", f"<= {int(limit[r, gi])}", str(int(zero[r, gi]))
        )
    return _csr_problem(t, codes, arrays, is4)


def _first_bad(index: np.ndarray, bound: int) -> int | None:
    """The position of the first entry out of ``[0, bound)`` or not above its predecessor."""
    bad = (index < 0) | (index >= bound)
    bad[1:] |= np.diff(index) <= 0
    return int(np.argwhere(bad)[0][0]) if bad.any() else None


def _csr_problem(t: QuantType, codes: np.ndarray, arrays: Mapping[str, np.ndarray], is4: np.ndarray) -> Problem | None:
    n, k, g = dims(t)
    rowptr, col = arrays["rowptr"].astype(np.int64), arrays["col"].astype(np.int64)
    nnz = col.shape[0]
    if rowptr[0] != 0 or rowptr[-1] != nnz or np.any(np.diff(rowptr) < 0):
        return Problem(
            "rowptr",
            "row pointers from 0 to the outlier count, never decreasing",
            f"0 .. {nnz}",
            f"{int(rowptr[0])} .. {int(rowptr[-1])}",
        )
    rows = np.repeat(np.arange(n), np.diff(rowptr))
    if nnz and (col.min() < 0 or col.max() >= k):
        i = int(np.argwhere((col < 0) | (col >= k))[0][0])
        return Problem(f"col[{i}]", "outlier column outside the row", f"in [0, {k})", str(int(col[i])))
    same_row = rows[1:] == rows[:-1]
    if np.any(same_row & (np.diff(col) <= 0)):
        i = int(np.argwhere(same_row & (np.diff(col) <= 0))[0][0]) + 1
        return Problem(
            f"col[{i}]", "outlier columns strictly increasing within a row", f"> {int(col[i - 1])}", str(int(col[i]))
        )
    in4 = is4[rows, col // g]
    if in4.any():
        i = int(np.argwhere(in4)[0][0])
        return Problem(
            f"col[{i}]",
            "outliers only inside 2-bit groups",
            "a 2-bit group",
            f"row {int(rows[i])}, column {int(col[i])} in a 4-bit group",
        )
    at_zero = codes[rows, col] == arrays["zero"][rows, col // g]
    if not at_zero.all():
        i = int(np.argwhere(~at_zero)[0][0])
        return Problem(
            f"codes[{int(rows[i])},{int(col[i])}]",
            "the code under an outlier is its group's zero point",
            str(int(arrays["zero"][rows[i], col[i] // g])),
            str(int(codes[rows[i], col[i]])),
        )
    return None


# --------------------------------------------------------------------------- packed layout


class PlanesLayout(Layout, family="mixprec", version=1):
    """Low plane of every code, then the high plane of the 4-bit groups (see the module docstring)."""

    encodings = ("planes-a16",)
    needs: ClassVar[tuple[str, ...]] = ("wide", "wide_rows")

    @classmethod
    def planes(cls, t: QuantType) -> tuple[int, int]:
        """Unpadded byte lengths of the low and high planes."""
        n, k, g = dims(t)
        return n * k // 4, wide_count(t) * g // 4

    @classmethod
    def physical(cls, t: QuantType) -> tuple[DType, tuple[int, ...]]:
        low, high = cls.planes(t)
        return DTYPES["u8"], (pad(low) + pad(high),)

    @classmethod
    def pack(cls, codes: np.ndarray, t: QuantType, slots: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        n, k, g = dims(t)
        wide = _wide(slots, n, k // g)
        low, high = cls.planes(t)
        out = np.zeros(pad(low) + pad(high), dtype=np.uint8)
        c = np.ascontiguousarray(codes, dtype=np.uint8)
        out[:low] = pack2(c.reshape(-1) & 3)
        groups = c.reshape(n * (k // g), g)
        narrow = np.ones(groups.shape[0], dtype=bool)
        narrow[wide] = False
        if np.any(groups[narrow] > 3):
            raise LayoutError("codes", "a 2-bit group holds a code above 3", "<= 3", "a wider code")
        out[pad(low) : pad(low) + high] = pack2((groups[wide] >> 2).reshape(-1))
        return out

    @classmethod
    def unpack(cls, blob: np.ndarray, t: QuantType, slots: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        n, k, g = dims(t)
        wide = _wide(slots, n, k // g)
        low, high = cls.planes(t)
        b = np.ascontiguousarray(blob, dtype=np.uint8).reshape(-1)
        if b.shape[0] != pad(low) + pad(high):
            raise LayoutError("codes", "packed planes of the wrong length", pad(low) + pad(high), b.shape[0])
        if b[low : pad(low)].any() or b[pad(low) + high :].any():
            raise LayoutError("codes", "alignment padding must be zero bytes", "zero", "a nonzero byte")
        codes = unpack2(b[:low]).reshape(n * (k // g), g)
        codes[wide] |= unpack2(b[pad(low) : pad(low) + high]).reshape(-1, g) << 2
        return codes.reshape(n, k)


def _wide(slots: Mapping[str, np.ndarray] | None, n: int, groups_per_row: int) -> np.ndarray:
    """Every 4-bit group, in the high plane's (flat group) order."""
    if slots is None or "wide" not in slots or "wide_rows" not in slots:
        want = "slots 'wide' and 'wide_rows'"
        raise LayoutError("wide", "the mixprec layout needs the precision map to (un)pack", want, "none")
    if (problem := map_problem(n, groups_per_row, slots["wide"], slots["wide_rows"])) is not None:
        raise LayoutError(problem.field, problem.message, problem.expected, problem.found)
    return four_bit(n, groups_per_row, slots["wide"], slots["wide_rows"])


def pack2(fields: np.ndarray) -> np.ndarray:
    """Two-bit fields (a multiple of four) -> bytes, four per byte, the first in the lowest bits."""
    f = fields.astype(np.uint8).reshape(-1, 4)
    return f[:, 0] | (f[:, 1] << 2) | (f[:, 2] << 4) | (f[:, 3] << 6)


def unpack2(packed: np.ndarray) -> np.ndarray:
    """Bytes -> their four two-bit fields each (``pack2``'s inverse), ``uint8``."""
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)
    return ((packed[:, None] >> shifts) & 3).astype(np.uint8).reshape(-1)

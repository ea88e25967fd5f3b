"""From a source's quantization state (codes, scale, zero, block size, code range) to a descriptor
and the arrays that bind it, without changing a single code or qparam value.

Normalisations are value-preserving and make the same codes give the same descriptor whatever the
source: qparams reshaped to ``[N, ceil(K/G)]``; an all-zero (or absent) zero point means symmetric;
zero points stored in the narrowest of i8/u8/i32 that holds them; float64 scales stored as float32
when every value is exactly representable; codes stored one per byte (i8 or u8).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from qcompiler.errors import QcError
from qcompiler.ir.descriptor import rate_claim
from qcompiler.ir.dtypes import DTYPES, code_dtype
from qcompiler.ir.minifloat import e4m3fn_nan_at
from qcompiler.ir.types import Alphabet, CodeContract, DenseType, GroupSpec, QuantType, ceil_div


class FreezeError(QcError):
    """Source quantization state that cannot be frozen as it is (names tensor, field, expected, found)."""


@dataclass(frozen=True)
class Described:
    """A descriptor plus the arrays bound to its slots (``codes`` and qparams, logical layout)."""

    type: QuantType
    arrays: dict[str, np.ndarray]


def code_type(qmin: int, qmax: int, where: str) -> tuple[bool, int]:
    signed = qmin < 0
    for bits in range(1, 9):
        c = code_dtype(f"{'i' if signed else 'u'}{bits}")
        assert c is not None
        if c.min <= qmin and qmax <= c.max:
            return signed, bits
    raise FreezeError(f"{where}: code range [{qmin}, {qmax}] needs more than 8 bits")


def group_of(shape: tuple[int, ...], block: list[int], where: str) -> GroupSpec | None:
    if len(block) != len(shape):
        raise FreezeError(f"{where}: block size {block} does not match the weight's rank {len(shape)}")
    if len(shape) == 2 and shape[0] > 1 and list(block) == list(shape):
        return None
    grouped = [i for i, b in enumerate(block) if b != 1]
    if not grouped:
        return GroupSpec(axis=len(shape) - 1, size=1)
    if len(grouped) > 1:
        raise FreezeError(f"{where}: two-dimensional blocks {block} are not an affine grouping QIR can state")
    axis = grouped[0]
    return GroupSpec(axis=axis, size=min(block[axis], shape[axis]))


def qparam_shape(shape: tuple[int, ...], group: GroupSpec | None) -> tuple[int, ...]:
    if group is None:
        return tuple(1 for _ in shape)
    return tuple(ceil_div(d, group.size) if i == group.axis else d for i, d in enumerate(shape))


def narrow_ints(a: np.ndarray) -> np.ndarray:
    for dt in (np.int8, np.uint8, np.int32):
        info = np.iinfo(dt)
        if a.size == 0 or (a.min() >= info.min and a.max() <= info.max):
            return a.astype(dt)
    raise FreezeError("zero points do not fit in 32 bits")


def exact_float(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.float64 and np.array_equal(a.astype(np.float32).astype(np.float64), a):
        return a.astype(np.float32)
    return a


def numpy_dtype_name(a: np.ndarray) -> str:
    names = {np.dtype(v.numpy): k for k, v in reversed(list(DTYPES.items())) if k not in ("bf16", "f8e4m3", "f8e5m2")}
    return names[a.dtype]


def act_order(where: str, g_idx: np.ndarray, shape: tuple[int, ...], group: GroupSpec | None) -> np.ndarray:
    """The permutation that stores act-order columns grouped; refuses a ``g_idx`` that does not put
    exactly ``G`` columns (the last group: the rest) in each group."""
    k = shape[-1]
    if group is None or group.axis != len(shape) - 1:
        raise FreezeError(f"{where}: g_idx needs groups along K (the last axis)")
    if g_idx.shape != (k,) or not np.issubdtype(g_idx.dtype, np.integer):
        raise FreezeError(
            f"{where}: g_idx must be {k} integers (one group index per column), found {g_idx.dtype}{list(g_idx.shape)}"
        )
    perm = np.argsort(g_idx, kind="stable").astype(np.int32)
    want = np.arange(k) // group.size
    got = g_idx[perm]
    if not np.array_equal(got, want):
        j = int(np.argwhere(got != want)[0][0])
        raise FreezeError(
            f"{where}: g_idx does not give every group {group.size} columns: stored column {j} "
            f"(original {int(perm[j])}) is in group {int(got[j])}, expected group {int(want[j])}"
        )
    return perm


def refuse_nan_patterns(where: str, codes: np.ndarray) -> None:
    """float8 E4M3FN codes hold no NaN (``0x7f``/``0xff``): a weight is never NaN."""
    if codes.dtype != np.uint8:
        raise FreezeError(f"{where}: float8 codes are uint8 bit patterns, found {codes.dtype}")
    idx = e4m3fn_nan_at(codes)
    if idx is not None:
        raise FreezeError(f"{where}: codes{list(idx)} is a float8 NaN pattern (0x{int(codes[idx]):02x})")


def describe(
    where: str,
    codes: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray | None,
    block: list[int],
    qmin: int,
    qmax: int,
    expressed: DenseType,
    req: str,
    g_idx: np.ndarray | None = None,
    scale_dtype: str = "",
    family: str = "affine",
) -> Described:
    """The descriptor and bound arrays for one source weight (see the module docstring).

    ``g_idx`` (GPTQ act-order: the group of each column along K) becomes an explicit permutation:
    columns are stored grouped (stable sort by group) and ``perm[j]`` names the original column of
    stored column ``j``; its inverse is ``argsort(perm)``, which the decoder applies as a scatter.
    ``scale_dtype`` ``bf16``: the scale array holds bfloat16 bits (``uint16``), kept as they are.
    ``family`` ``f8e4m3``: the codes are float8 E4M3FN bit patterns (``u8[0:255]``, no NaN pattern).
    """
    shape = tuple(int(d) for d in codes.shape)
    if not np.issubdtype(codes.dtype, np.integer):
        raise FreezeError(f"{where}: codes must be integers, found {codes.dtype}")
    if codes.size and (int(codes.min()) < qmin or int(codes.max()) > qmax):
        outside = (codes < qmin) | (codes > qmax)
        idx = tuple(int(i) for i in np.argwhere(outside)[0])
        raise FreezeError(
            f"{where}: codes{list(idx)} = {int(codes[idx])} lies outside the declared range [{qmin}, {qmax}]"
        )
    if family == "f8e4m3":
        refuse_nan_patterns(where, codes)
    signed, bits = code_type(qmin, qmax, where)
    code = code_dtype(f"{'i' if signed else 'u'}{bits}")
    assert code is not None
    group = group_of(shape, block, where)
    qshape = qparam_shape(shape, group)
    perm = act_order(where, g_idx, shape, group) if g_idx is not None else None
    stored = codes if perm is None else np.take(codes, perm, axis=len(shape) - 1)
    # stored codes already of the code dtype are kept as they are, not copied: the blob store then
    # knows their sha256 (``blobs.put_array``) and a 1.1B model's 1 GB of codes is not hashed again
    arrays: dict[str, np.ndarray] = {"codes": stored.astype(np.int8 if signed else np.uint8, copy=False)}
    if scale.size != int(np.prod(qshape)):
        raise FreezeError(f"{where}: scale has {scale.size} values, but the grouping needs shape {list(qshape)}")
    arrays["scale"] = exact_float(scale.reshape(qshape))
    if zero is not None and np.any(zero != 0):
        if zero.size != scale.size:
            raise FreezeError(f"{where}: zero point has {zero.size} values, expected {scale.size} like the scale")
        arrays["zero"] = narrow_ints(zero.reshape(qshape).astype(np.int64))
    bf16 = scale_dtype == "bf16" and scale.dtype == np.uint16
    slots = tuple(
        (n, DenseType(DTYPES["bf16" if n == "scale" and bf16 else numpy_dtype_name(a)], qshape))
        for n, a in arrays.items()
        if n != "codes"
    )
    if perm is not None:
        arrays["perm"] = perm
    t = QuantType(
        family=family,
        code=CodeContract(code, Alphabet.range(qmin, qmax)),
        expressed=expressed,
        group=group,
        qparams=slots,
        perm=None if perm is None else DenseType(DTYPES["i32"], (shape[-1],)),
        req=req,
    )
    incl = ("codes", *(n for n, _ in slots), *(("perm",) if perm is not None else ()))
    return Described(dataclasses.replace(t, rate=rate_claim(t, incl)), arrays)

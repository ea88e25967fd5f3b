"""Rewrites of a weight's descriptor that keep its codes and every decoded value, so that a target can
hold it exactly (a ``LayoutPlan`` of kind ``refine``). ``pack-layouts`` applies them without
``allow-conversion`` and records each (kind, the decode compared before and after); a rewrite whose
decode moved (``lossless`` false) is a conversion, refused unless allowed.

- ``regroup``: groups of ``G`` along K become groups of ``to`` (``G`` a multiple of it); every
  scale and zero point is repeated ``G / to`` times. Always lossless.
- ``affine-min``: an asymmetric affine weight becomes the nested ``d * u - min`` form of ggml's
  Q4_1/Q5_1: ``u = q - qmin`` (unsigned: the nibbles GPTQ/AWQ stored), ``d = scale``,
  ``min = scale * (zero - qmin)``. Lossless when every ``min`` is exact in the scales' dtype.

Both derive from ``x = (q - z) * s``: repeating ``s`` and ``z`` per sub-group changes nothing, and
``s * u - s * (z - qmin) = s * (q - z)`` exactly in float32 when the product ``s * (z - qmin)`` is
representable where ``min`` is stored.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from qcompiler.errors import PassError
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import read_array, read_float32, store
from qcompiler.ir.core import Module, Op
from qcompiler.ir.descriptor import rate_claim
from qcompiler.ir.dtypes import DTYPES, CodeDType
from qcompiler.ir.rewrite import Rewriter
from qcompiler.ir.types import Alphabet, DenseType, GroupSpec, QuantType
from qcompiler.parity import decoded
from qcompiler.passes.conversions import CONVERSIONS, Conversion, as_dtype, error


def bound(op: Op, slot: str) -> str:
    ref = op.attrs.get(slot)
    if not isinstance(ref, SymbolRef):
        raise PassError(f"{op.describe()}: slot {slot} is not bound to a tensor")
    return ref.name


def retype(op: Op, t: QuantType, new: QuantType, renamed: dict[str, str] | None = None) -> QuantType:
    """``op``'s result becomes ``new``, its claimed rate recounted (``renamed``: slots that changed name)."""
    if (r := t.rate) is not None:  # the qparams' sizes changed, and the claimed rate with it
        incl = tuple((renamed or {}).get(p, p) for p in r.incl)
        new = dataclasses.replace(new, rate=rate_claim(new, incl, r.unit, r.scope))
    op.results[0].type = new
    return new


def record(kind: str, before: np.ndarray, after: np.ndarray, **extra: AttrValue) -> dict[str, AttrValue]:
    measured = error(before, after)
    return {"kind": kind, **extra, **measured, "lossless": bool(np.array_equal(before, after))}


def regroup(m: Module, rw: Rewriter, op: Op, t: QuantType, name: str, to: str = "") -> dict[str, AttrValue]:
    assert t.group is not None
    size, new_size = t.group.size, int(to)
    if size % new_size or t.group.axis != 1:
        raise PassError(f"{name}: groups of {size} along axis {t.group.axis} cannot become groups of {new_size}")
    before, factor = decoded(m, op, t), size // new_size
    k = int(t.shape[1])
    qparams = []
    for slot, s in t.qparams:
        if not isinstance(s, DenseType):
            raise PassError(f"{name}: a quantized qparam ({slot}) cannot be regrouped")
        ref = bound(op, slot)
        values = np.repeat(np.asarray(read_array(m, ref)), factor, axis=1)[:, : -(-k // new_size)]
        store(m, ref, np.ascontiguousarray(values), s.dtype)
        qparams.append((slot, DenseType(s.dtype, (s.shape[0], int(values.shape[1])))))
    new = retype(op, t, dataclasses.replace(t, group=GroupSpec(1, new_size, t.group.tail), qparams=tuple(qparams)))
    return record("regroup", before, decoded(m, op, new), **{"from": size, "to": new_size})


def affine_min(m: Module, rw: Rewriter, op: Op, t: QuantType, name: str, to: str = "") -> dict[str, AttrValue]:
    scale_t, zero_t = t.qparam("scale"), t.qparam("zero")
    if not (isinstance(scale_t, DenseType) and isinstance(zero_t, DenseType) and t.code.dtype.signed):
        raise PassError(f"{name}: affine-min needs signed codes with a dense scale and zero point")
    before, lo = decoded(m, op, t), t.code.dtype.min
    codes_ref, zero_ref = bound(op, "codes"), bound(op, "zero")
    u = (np.asarray(read_array(m, codes_ref)).astype(np.int16) - lo).astype(np.uint8)
    unsigned = CodeDType(False, t.code.dtype.bits)
    store(m, codes_ref, u, DTYPES["u8"])
    zero = np.asarray(read_array(m, zero_ref)).astype(np.float32) - np.float32(lo)
    low = as_dtype(read_float32(m, bound(op, "scale")) * zero, scale_t.dtype.name)
    min_ref = zero_ref.removesuffix(".zero") + ".min"
    placed = m.tensors.pop(zero_ref).attrs  # placement and file shard carry over
    store(m, min_ref, np.ascontiguousarray(low), scale_t.dtype, dict(placed))
    op.attrs.pop("zero")
    op.attrs["min"] = SymbolRef(min_ref)
    code = dataclasses.replace(
        t.code, dtype=unsigned, alphabet=Alphabet(t.code.alphabet.lo - lo, t.code.alphabet.hi - lo)
    )
    qparams = (("scale", scale_t), ("min", DenseType(scale_t.dtype, zero_t.shape)))
    new = retype(op, t, dataclasses.replace(t, family="nested", code=code, qparams=qparams), {"zero": "min"})
    return record("affine-min", before, decoded(m, op, new), to=scale_t.dtype.name)


REFINEMENTS: dict[str, Conversion] = {"regroup": regroup, "affine-min": affine_min}
REWRITES: dict[str, Conversion] = {**CONVERSIONS, **REFINEMENTS}
"""Every rewrite a ``LayoutPlan`` may name, by ``convert``."""

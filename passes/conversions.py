"""Conversions ``pack-layouts`` may apply when a target cannot hold a weight exactly (only with
``allow-conversion``). Each rewrites one ``q.weight`` and returns what it changed and the error it
measured, which goes into the module's ``conversions`` attribute and from there into the manifest.

| name | what changes |
|---|---|
| ``dense`` | the weight is stored decoded in its expressed dtype; ``q.linear`` -> ``linear`` (``DENSE_USES``) |
| ``scale-dtype`` | scales are rounded to the plan's dtype (default: the expressed dtype) |

The error is the decode before against the values after (``dense``: 0 in f32, since only the rate
changes; the rate before and after is recorded too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from qcompiler.errors import PassError
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import read_float32, store
from qcompiler.ir.core import Module, Op, create_op
from qcompiler.ir.descriptor import part_bits, rate_claim, slot_bits
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.minifloat import round_to_bf16
from qcompiler.ir.rewrite import Pattern, Rewriter
from qcompiler.ir.symbols import op_refs
from qcompiler.ir.types import DenseType, QuantType
from qcompiler.parity import decoded

Conversion = Callable[[Module, Rewriter, Op, QuantType, str, str], dict[str, AttrValue]]
"""``(module, rewriter of its graph, q.weight op, its type, weight name, target dtype or "") -> record``."""
DENSE_OF = {"q.linear": "linear", "q.embedding": "embedding"}


def refused(name: str, target: str, reason: str) -> PassError:
    """The error for a weight whose plan is a conversion, when ``allow-conversion`` is off."""
    return PassError(
        f"{name}: storing this weight in {target} is a conversion ({reason}); refused. "
        "Allow it with --allow-conversion (pack-layouts{allow-conversion=true}); its error is "
        "then measured and recorded in the manifest"
    )


def as_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the IR container of ``dtype`` (bf16 as raw uint16 bits, rounded to nearest even)."""
    if dtype == "bf16":
        return (round_to_bf16(values.astype(np.float32)).view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(DTYPES[dtype].numpy)


def error(before: np.ndarray, after: np.ndarray) -> dict[str, AttrValue]:
    diff = after.astype(np.float64) - before.astype(np.float64)
    norm = float(np.linalg.norm(before.astype(np.float64))) or 1.0
    return {
        "max_abs_err": float(np.max(np.abs(diff))) if diff.size else 0.0,
        "rel_l2": float(np.linalg.norm(diff)) / norm,
    }


def to_dense(m: Module, rw: Rewriter, op: Op, t: QuantType, name: str, to: str = "") -> dict[str, AttrValue]:
    for user in rw.users(op.result):
        if user.name not in DENSE_OF and user.name != "q.dequantize":
            raise PassError(f"{user.describe()}: cannot use a weight converted to dense (no dense form of {user.name})")
    before = decoded(m, op, t)
    dtype = t.expressed.dtype.name
    stored = as_dtype(before, dtype)
    codes = op.attrs["codes"]
    assert isinstance(codes, SymbolRef)
    attrs = dict(m.tensors[codes.name].attrs)  # placement and file shard carry over
    for ref in op_refs(op):  # nested bindings (K-quant scales) included
        m.tensors.pop(ref, None)
    store(m, name, stored, DTYPES[dtype], attrs)
    const = create_op("const", [], [t.expressed], {"ref": SymbolRef(name)}, [op.result.name])
    rw.replace(op, const)  # its users now read the dense value; ``DENSE_USES`` rewrites them
    after = read_float32(m, name)
    bits_before = part_bits(t, "codes") + sum(slot_bits(s) for _, s in t.qparams)
    return {
        "kind": "dense",
        **error(before, after),
        "rate_bits_before": bits_before,
        "rate_bits_after": stored.nbytes * 8,
    }


def scale_dtype(m: Module, rw: Rewriter, op: Op, t: QuantType, name: str, to: str = "") -> dict[str, AttrValue]:
    before = decoded(m, op, t)
    ref = op.attrs["scale"]
    assert isinstance(ref, SymbolRef)
    old = t.qparam("scale")
    assert isinstance(old, DenseType)
    dtype = to or t.expressed.dtype.name
    store(m, ref.name, as_dtype(read_float32(m, ref.name), dtype), DTYPES[dtype])
    qparams = tuple(
        (k, DenseType(DTYPES[dtype], s.shape) if k == "scale" and isinstance(s, DenseType) else s) for k, s in t.qparams
    )
    new_t = dataclasses.replace(t, qparams=qparams)
    if (r := t.rate) is not None:  # the scales' width changed, and the claimed rate with it
        new_t = dataclasses.replace(new_t, rate=rate_claim(new_t, r.incl, r.unit, r.scope))
    op.results[0].type = new_t
    return {"kind": "scale-dtype", "from": old.dtype.name, "to": dtype, **error(before, decoded(m, op, new_t))}


def dense_op(rw: Rewriter, op: Op) -> bool:
    """``q.linear``/``q.embedding`` whose weight was converted to dense -> ``linear``/``embedding``."""
    w = op.operand("w") if op.name in DENSE_OF else None
    if w is None or w.dense is None:
        return False
    types, names = [r.type for r in op.results], [r.name for r in op.results]
    rw.replace(op, create_op(DENSE_OF[op.name], list(op.operands), types, dict(op.attrs), names))
    return True


def dense_dequantize(rw: Rewriter, op: Op) -> bool:
    """``q.dequantize`` of a weight converted to dense -> its uses read the dense weight."""
    w = op.operand("x") if op.name == "q.dequantize" else None
    if w is None or w.dense is None:
        return False
    rw.replace_uses(op.result, w)
    rw.erase(op)
    return True


DENSE_USES: tuple[Pattern, ...] = (dense_op, dense_dequantize)
"""Patterns for the users of a weight ``to_dense`` converted (they come after it in program order)."""
CONVERSIONS: dict[str, Conversion] = {"dense": to_dense, "scale-dtype": scale_dtype}

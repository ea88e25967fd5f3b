"""``canonicalize-axes``: one orientation for quantized weights, ``[N, K]`` (out x in), groups along K.

A weight stored ``[K, N]`` with groups along K (axis 0) that is dequantized and then used as the
right operand of ``matmul`` (or transposed) is rewritten as its ``[N, K]`` transpose with groups
along axis 1: codes and qparams are transposed, never changed, and the pass proves
``decode(W') == decode(W).T`` bit for bit. The tail-group rule is already explicit in every
descriptor (``tail=partial``); a permutation stays along the group axis with the weight. A weight
grouped along N cannot be made canonical without requantizing and is refused; so is a weight
used both as [N, K] and as [K, N]. A per-tensor [K, N] weight is transposed the same way.

Before::

    %w = q.weight() {...} : !q.affine<i4[-8:7] -> f32[96,64], ..., group=(axis=0, size=32, ...), ...>
    %wd = q.dequantize(%w) : tensor<f32[96,64]>
    %y = matmul(%x, %wd) : tensor<f32[4,64]>

After: ``%w`` is ``f32[64,96]`` with ``group=(axis=1, ...)`` and ``%y = linear(%x, %wd)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from qcompiler.errors import PassError
from qcompiler.ir.attrs import SymbolRef
from qcompiler.ir.blobs import read_array, store
from qcompiler.ir.core import Module, Op, create_op
from qcompiler.ir.ops.dense import Transpose
from qcompiler.ir.ops.quant import weight_name
from qcompiler.ir.reference import decode
from qcompiler.ir.rewrite import Rewriter, apply
from qcompiler.ir.types import DenseType, QuantType
from qcompiler.passes.base import Pass, PassContext


def transposed(t: QuantType) -> QuantType:
    n, k = t.shape

    def flip(s: DenseType) -> DenseType:
        return DenseType(s.dtype, (s.shape[1], s.shape[0]))

    qparams = tuple((name, flip(s)) for name, s in t.qparams if isinstance(s, DenseType))
    return dataclasses.replace(
        t,
        expressed=DenseType(t.expressed.dtype, (k, n)),
        group=None if t.group is None else dataclasses.replace(t.group, axis=1),
        qparams=qparams,
        req="linear" if t.req in ("matmul", "any") else t.req,
    )


def use_kind(rw: Rewriter, u: Op, dq: Op) -> str:
    """How one user consumes a dequantized weight: as a canonical [N, K] (linear/embedding) or as
    [K, N] (right operand of matmul, or transposed for a linear)."""
    if u.name == "linear" and u.operand("w") is dq.result:
        return "linear"
    if u.name == "embedding" and u.operand("w") is dq.result:
        return "embedding"
    if u.name == "matmul" and u.operand("b") is dq.result:
        return "matmul"
    later = rw.users(u.result)
    feeds_linears = bool(later) and all(x.name == "linear" and x.operand("w") is u.result for x in later)
    if isinstance(u, Transpose) and u.perm == [1, 0] and feeds_linears:
        return "transpose"
    position = u.operands.index(dq.result)
    return u.name if u.name not in ("matmul", "linear", "embedding") else f"{u.name} (operand {position})"


def refuse(w: Op, why: str, conversion: bool = True) -> PassError:
    tail = "; making it [N, K] with groups along K would need requantization" if conversion else ""
    return PassError(f"canonicalize-axes: {SymbolRef(weight_name(w))} {why}{tail}")


def canonicalize(m: Module, rw: Rewriter, dq: Op) -> bool:
    """Pattern on ``q.dequantize`` of a ``q.weight``: orient the weight [N, K] (see the module docstring)."""
    src = dq.operand("x") if dq.name == "q.dequantize" else None
    w = None if src is None else src.producer
    if w is None or w.name != "q.weight":
        return False
    t = w.result.quant
    uses = rw.users(dq.result)
    if t is None or t.rank != 2 or not uses:
        return False
    kinds = {use_kind(rw, u, dq) for u in uses}
    if kinds <= {"linear", "embedding"}:
        if "linear" in kinds and t.group is not None and t.group.axis == 0:
            raise refuse(w, "is a linear weight [N, K] grouped along N (axis 0)")
        return False
    if not kinds <= {"matmul", "transpose"}:
        uses_text = ", ".join(sorted(kinds))
        why = (
            f"is used by {uses_text}; only weights of linear/embedding ([N, K]) or of matmul's right operand "
            "([K, N]) can be oriented, all uses alike"
        )
        raise refuse(w, why, conversion=False)
    if t.group is not None and t.group.axis == 1:
        raise refuse(w, "is a [K, N] weight grouped along N (axis 1)")
    arrays = {k: read_array(m, v.name) for k, v in w.attrs.items() if isinstance(v, SymbolRef)}
    new_t = transposed(t)
    flipped = {k: np.ascontiguousarray(a.T) if a.ndim == 2 else a for k, a in arrays.items()}
    before, after = np.asarray(decode(t, arrays)), np.asarray(decode(new_t, flipped))
    if not np.array_equal(before.T.view(np.uint32), after.view(np.uint32)):
        raise PassError(f"canonicalize-axes: transposing {w.describe()} changed its decode")
    for key, ref in w.attrs.items():
        assert isinstance(ref, SymbolRef)
        store(m, ref.name, flipped[key], m.tensors[ref.name].blob.dtype)
    w.results[0].type = new_t
    dq.results[0].type = new_t.expressed
    for u in uses:
        if u.name == "transpose":
            rw.replace_uses(u.result, dq.result)
            rw.erase(u)
            continue
        x = u.operand("a")
        assert x is not None
        rw.replace(u, create_op("linear", [x, dq.result], [u.result.type], result_names=[u.result.name]))
    return True


@dataclass(frozen=True)
class CanonicalizeAxesPass(Pass):
    """Bring quantized weights to [N, K] with groups along K, proving decode is unchanged."""

    name: ClassVar[str] = "canonicalize-axes"
    summary: ClassVar[str] = "quantized weights as [N, K] with groups along K"
    requires: ClassVar[frozenset[str]] = frozenset({"semantics-frozen"})
    establishes: ClassVar[frozenset[str]] = frozenset({"axes-canonical"})

    def run(self, module: Module, ctx: PassContext) -> Module:
        def orient(rw: Rewriter, op: Op) -> bool:
            if not canonicalize(module, rw, op):
                return False
            ctx.count("canonicalize-axes.transposed")
            return True

        for g in module.graphs:
            apply(g, [orient])
        return module

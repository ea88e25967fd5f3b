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
from qcompiler.ir.core import Graph, Module, Op, create_op
from qcompiler.ir.ops.quant import weight_name
from qcompiler.ir.reference import decode
from qcompiler.ir.rewrite import replace_uses
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


def use_kind(u: Op, dq: Op, users: dict[int, list[Op]]) -> str:
    """How one user consumes a dequantized weight: as a canonical [N, K] (linear/embedding) or as
    [K, N] (right operand of matmul, or transposed for a linear)."""
    if u.name == "linear" and u.operands[1] is dq.result:
        return "linear"
    if u.name == "embedding" and u.operands[0] is dq.result:
        return "embedding"
    if u.name == "matmul" and u.operands[1] is dq.result:
        return "matmul"
    later = users.get(id(u.result), [])
    feeds_linears = bool(later) and all(x.name == "linear" and x.operands[1] is u.result for x in later)
    if u.name == "transpose" and u.attrs.get("perm") == [1, 0] and feeds_linears:
        return "transpose"
    position = u.operands.index(dq.result)
    return u.name if u.name not in ("matmul", "linear", "embedding") else f"{u.name} (operand {position})"


def refuse(w: Op, why: str, conversion: bool = True) -> PassError:
    tail = "; making it [N, K] with groups along K would need requantization" if conversion else ""
    return PassError(f"canonicalize-axes: {SymbolRef(weight_name(w))} {why}{tail}")


def canonicalize(m: Module, g: Graph, w: Op, dq: Op, users: dict[int, list[Op]]) -> bool:
    t = w.result.quant
    uses = users.get(id(dq.result), [])
    if t is None or t.rank != 2 or not uses:
        return False
    kinds = {use_kind(u, dq, users) for u in uses}
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
            replace_uses(g, u.result, dq.result)
            g.ops.remove(u)
            continue
        linear = create_op("linear", [u.operands[0], dq.result], [u.result.type], result_names=[u.result.name])
        g.ops[g.ops.index(u)] = linear
        replace_uses(g, u.result, linear.result)
    return True


@dataclass(frozen=True)
class CanonicalizeAxesPass(Pass):
    """Bring quantized weights to [N, K] with groups along K, proving decode is unchanged."""

    name: ClassVar[str] = "canonicalize-axes"
    summary: ClassVar[str] = "quantized weights as [N, K] with groups along K"
    requires: ClassVar[frozenset[str]] = frozenset({"semantics-frozen"})
    establishes: ClassVar[frozenset[str]] = frozenset({"axes-canonical"})

    def run(self, module: Module, ctx: PassContext) -> Module:
        for g in module.graphs:
            made_by = {id(r): op for op in g.ops for r in op.results}
            users = g.users()
            for dq in [op for op in g.ops if op.name == "q.dequantize"]:
                w = made_by.get(id(dq.operands[0]))
                if w is not None and w.name == "q.weight" and canonicalize(module, g, w, dq, users):
                    ctx.count("canonicalize-axes.transposed")
                    users = g.users()  # the rewrite replaced consumers
        return module

"""``canonicalize-axes``: one orientation for quantized weights, ``[N, K]`` (out x in), groups along K.

A weight stored ``[K, N]`` with groups along K (axis 0) that is dequantized and then used as the
right operand of ``matmul`` (or transposed) is rewritten as its ``[N, K]`` transpose with groups
along axis 1: codes and qparams are transposed, never changed, and the pass proves
``decode(W') == decode(W).T`` bit for bit. The tail-group rule is already explicit in every
descriptor (``tail=partial``); a permutation stays along the group axis with the weight. A weight
grouped along N cannot be made canonical without requantizing and is refused.

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
from qcompiler.passes.base import Pass, PassContext

from qcompiler.errors import PassError
from qcompiler.ir.attrs import SymbolRef
from qcompiler.ir.blobs import put_array, read_array
from qcompiler.ir.core import Graph, Module, Op, TensorDecl, create_op
from qcompiler.ir.types import DenseType, QuantType
from qcompiler.quant.reference import decode


def transposed(t: QuantType) -> QuantType:
    assert t.group is not None
    n, k = t.shape

    def flip(s: DenseType) -> DenseType:
        return DenseType(s.dtype, (s.shape[1], s.shape[0]))

    qparams = tuple((name, flip(s)) for name, s in t.qparams if isinstance(s, DenseType))
    return dataclasses.replace(
        t,
        expressed=DenseType(t.expressed.dtype, (k, n)),
        group=dataclasses.replace(t.group, axis=1),
        qparams=qparams,
    )


def canonicalize(m: Module, g: Graph, w: Op, dq: Op, uses: list[Op]) -> bool:
    t = w.result.quant
    if t is None or t.rank != 2 or t.group is None or t.group.axis == 1:
        return False
    if not all(u.name == "matmul" and u.operands[1] is dq.result for u in uses):
        name = str(w.attrs["codes"]).removesuffix(".codes")
        raise PassError(
            f"canonicalize-axes: {name} groups along axis 0 and is used as {[u.name for u in uses]}; "
            "making it [N, K] with groups along K would need requantization (a conversion)"
        )
    arrays = {k: read_array(m, v.name) for k, v in w.attrs.items() if isinstance(v, SymbolRef)}
    new_t = transposed(t)
    flipped = {k: np.ascontiguousarray(a.T) for k, a in arrays.items()}
    before, after = np.asarray(decode(t, arrays)), np.asarray(decode(new_t, flipped))
    if not np.array_equal(before.T.view(np.uint32), after.view(np.uint32)):
        raise PassError(f"canonicalize-axes: transposing {w.describe()} changed its decode")
    for key, ref in w.attrs.items():
        assert isinstance(ref, SymbolRef)
        old = m.tensors[ref.name]
        m.tensors[ref.name] = TensorDecl(ref.name, put_array(flipped[key], old.blob.dtype), old.attrs)
    w.results[0].type = new_t
    dq.results[0].type = new_t.expressed
    for u in uses:
        linear = create_op("linear", [u.operands[0], dq.result], [u.result.type], result_names=[u.result.name])
        g.ops[g.ops.index(u)] = linear
        for op in g.ops:
            op.operands = [linear.result if v is u.result else v for v in op.operands]
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
            users = g.users()
            for dq in [op for op in g.ops if op.name == "q.dequantize"]:
                w = next((op for op in g.ops if dq.operands[0] in op.results and op.name == "q.weight"), None)
                if w is not None and canonicalize(module, g, w, dq, users.get(id(dq.result), [])):
                    ctx.count("canonicalize-axes.transposed")
        return module

"""``fuse-qdq``: fold ``q.dequantize -> linear/embedding`` into ``q.linear``/``q.embedding``, or
(``direction=materialize``) the reverse, for targets that want graph-level QDQ.

A dequantize is folded only when its operand is a ``q.weight`` (constant qparams) and every user
consumes it as its weight (a weight shared by several linears folds into each of them); a
dequantize with any other user stays. Activation ``q.quantize``/``q.dequantize`` pairs stay explicit.
Both directions keep the same descriptor, so decode is unchanged by construction. The chosen form
is recorded as the module attribute ``qdq_form`` and checked by the ``qdq-fused`` invariant.

Fold, before / after::

    %wd = q.dequantize(%w) : tensor<f32[64,32]>          %y = q.linear(%x, %w, %b) : tensor<f32[?b,64]>
    %y = linear(%x, %wd, %b) : tensor<f32[?b,64]>
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qcompiler.errors import PipelineError
from qcompiler.ir.core import Graph, Module, Op, create_op
from qcompiler.ir.module_attrs import QDQ_FOLD, QDQ_FORMS, QDQ_MATERIALIZE
from qcompiler.ir.ops.quant import Dequantize
from qcompiler.ir.ops.shapes import quant
from qcompiler.ir.rewrite import Rewriter, apply
from qcompiler.passes.base import Pass, PassContext

FOLDS = {"linear": ("q.linear", 1), "embedding": ("q.embedding", 0)}
"""dense op -> (quantized op, operand index of the weight)."""
MATERIALIZE = {q: (dense, i) for dense, (q, i) in FOLDS.items()}


def foldable(u: Op, dq: Op) -> bool:
    rule = FOLDS.get(u.name)
    return rule is not None and u.operands[rule[1]] is dq.result


def fold(g: Graph) -> int:
    """Fold each weight dequantize all of whose users take it as their weight; a dequantize with
    any other user stays, and so do its uses. Returns how many users were folded."""
    folded = 0

    def weight_dequantize(rw: Rewriter, dq: Op) -> bool:
        nonlocal folded
        if not isinstance(dq, Dequantize):
            return False
        src, uses = dq.x.producer, rw.users(dq.result)
        if src is None or src.name != "q.weight" or not uses:
            return False
        if not all(foldable(u, dq) for u in uses):
            return False
        for u in uses:
            name, i = FOLDS[u.name]
            operands = list(u.operands)
            operands[i] = src.result
            rw.replace(u, create_op(name, operands, [u.result.type], result_names=[u.result.name]))
        rw.erase(dq)
        folded += len(uses)
        return True

    apply(g, [weight_dequantize])
    return folded


def unfold(rw: Rewriter, op: Op) -> bool:
    """``q.linear``/``q.embedding`` -> an explicit ``q.dequantize`` of its weight, then the dense op."""
    rule = MATERIALIZE.get(op.name)
    if rule is None:
        return False
    w = op.operands[rule[1]]
    dq = create_op("q.dequantize", [w], [quant(w).expressed], result_names=[f"{w.name}_dq"])
    rw.insert_before(op, dq)
    operands = list(op.operands)
    operands[rule[1]] = dq.result
    rw.replace(op, create_op(rule[0], operands, [op.result.type], result_names=[op.result.name]))
    return True


def materialize(g: Graph) -> int:
    return apply(g, [unfold])


@dataclass(frozen=True)
class FuseQdqPass(Pass):
    """Fold (or materialise) weight dequantize -> op patterns."""

    name: ClassVar[str] = "fuse-qdq"
    summary: ClassVar[str] = "dequantize->linear/embedding into q.linear/q.embedding, or back"
    requires: ClassVar[frozenset[str]] = frozenset({"semantics-frozen", "axes-canonical"})
    establishes: ClassVar[frozenset[str]] = frozenset({"qdq-fused"})

    direction: str = QDQ_FOLD
    """``fold`` into quantized ops, or ``materialize`` explicit dequantize for QDQ targets."""

    def run(self, module: Module, ctx: PassContext) -> Module:
        rewrite = {QDQ_FOLD: fold, QDQ_MATERIALIZE: materialize}.get(self.direction)
        if rewrite is None:
            raise PipelineError(f"fuse-qdq: direction must be {' or '.join(QDQ_FORMS)}, found {self.direction!r}")
        for g in module.graphs:
            ctx.count(f"fuse-qdq.{self.direction}", rewrite(g))
        module.attrs["qdq_form"] = self.direction
        return module

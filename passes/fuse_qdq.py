"""``fuse-qdq``: fold ``q.dequantize -> linear/embedding`` into ``q.linear``/``q.embedding``, or
(``direction=materialize``) the reverse, for targets that want graph-level QDQ.

A dequantize is folded only when its operand is a ``q.weight`` (constant qparams) and its single
user consumes it as the weight. Activation ``q.quantize``/``q.dequantize`` pairs stay explicit.
Both directions keep the same descriptor, so decode is unchanged by construction. The chosen form
is recorded as the module attribute ``qdq_form`` and checked by the ``qdq-fused`` invariant.

Fold, before / after::

    %wd = q.dequantize(%w) : tensor<f32[64,32]>          %y = q.linear(%x, %w, %b) : tensor<f32[?b,64]>
    %y = linear(%x, %wd, %b) : tensor<f32[?b,64]>
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qcompiler.passes.base import Pass, PassContext

from qcompiler.errors import PipelineError
from qcompiler.ir.core import Graph, Module, Op, create_op
from qcompiler.ir.ops.shapes import quant

FOLDS = {"linear": ("q.linear", 1), "embedding": ("q.embedding", 0)}
"""dense op -> (quantized op, operand index of the weight)."""
MATERIALIZE = {q: (dense, i) for dense, (q, i) in FOLDS.items()}


def fold(g: Graph) -> int:
    made_by = {id(r): op for op in g.ops for r in op.results}
    users = g.users()
    out: list[Op] = []
    dead: set[int] = set()
    n = 0
    for op in g.ops:
        rule = FOLDS.get(op.name)
        w_index = rule[1] if rule else -1
        dq = made_by.get(id(op.operands[w_index])) if rule else None
        src = made_by.get(id(dq.operands[0])) if dq is not None and dq.name == "q.dequantize" else None
        if (
            rule is None
            or dq is None
            or src is None
            or src.name != "q.weight"
            or len(users.get(id(dq.result), [])) != 1
        ):
            out.append(op)
            continue
        operands = list(op.operands)
        operands[w_index] = src.result
        out.append(create_op(rule[0], operands, [op.result.type], result_names=[op.result.name]))
        for later in g.ops:
            later.operands = [out[-1].result if v is op.result else v for v in later.operands]
        dead.add(id(dq))
        n += 1
    g.ops = [op for op in out if id(op) not in dead]
    return n


def materialize(g: Graph) -> int:
    out: list[Op] = []
    n = 0
    for op in g.ops:
        rule = MATERIALIZE.get(op.name)
        if rule is None:
            out.append(op)
            continue
        w = op.operands[rule[1]]
        dq = create_op("q.dequantize", [w], [quant(w).expressed], result_names=[f"{w.name}_dq"])
        operands = list(op.operands)
        operands[rule[1]] = dq.result
        dense = create_op(rule[0], operands, [op.result.type], result_names=[op.result.name])
        for later in g.ops:
            later.operands = [dense.result if v is op.result else v for v in later.operands]
        out += [dq, dense]
        n += 1
    g.ops = out
    return n


@dataclass(frozen=True)
class FuseQdqPass(Pass):
    """Fold (or materialise) weight dequantize -> op patterns."""

    name: ClassVar[str] = "fuse-qdq"
    summary: ClassVar[str] = "dequantize->linear/embedding into q.linear/q.embedding, or back"
    requires: ClassVar[frozenset[str]] = frozenset({"semantics-frozen", "axes-canonical"})
    establishes: ClassVar[frozenset[str]] = frozenset({"qdq-fused"})

    direction: str = "fold"
    """``fold`` into quantized ops, or ``materialize`` explicit dequantize for QDQ targets."""

    def run(self, module: Module, ctx: PassContext) -> Module:
        rewrite = {"fold": fold, "materialize": materialize}.get(self.direction)
        if rewrite is None:
            raise PipelineError(f"fuse-qdq: direction must be fold or materialize, found {self.direction!r}")
        for g in module.graphs:
            ctx.count(f"fuse-qdq.{self.direction}", rewrite(g))
        module.attrs["qdq_form"] = self.direction
        return module

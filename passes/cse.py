"""``cse``: merge ops that compute the same thing (same op, operands, attributes, result types).

Every op in the IR is pure, so the later duplicate is dropped and its uses point at the first::

    %a = const() {ref = @w} : tensor<f32[4]>
    %b = const() {ref = @w} : tensor<f32[4]>
    %y = add(%a, %b) : tensor<f32[4]>

becomes ``%y = add(%a, %a)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qcompiler.ir.attrs import format_attr_dict
from qcompiler.ir.core import Graph, Module, Op, Value
from qcompiler.passes.base import Pass, PassContext

NEVER_MERGED = ("return", "test.producer")


def op_key(op: Op, rename: dict[int, Value]) -> tuple[object, ...]:
    operands = tuple(id(rename.get(id(v), v)) for v in op.operands)
    types = tuple(str(r.type) for r in op.results)
    return (op.name, operands, format_attr_dict(op.attrs), types)


def merge(g: Graph) -> int:
    seen: dict[tuple[object, ...], Op] = {}
    rename: dict[int, Value] = {}
    kept: list[Op] = []
    for op in g.ops:
        op.operands = [rename.get(id(v), v) for v in op.operands]
        key = op_key(op, rename)
        first = seen.get(key) if op.name not in NEVER_MERGED else None
        if first is None:
            seen[key] = op
            kept.append(op)
            continue
        for dup, orig in zip(op.results, first.results, strict=True):
            rename[id(dup)] = orig
    removed = len(g.ops) - len(kept)
    g.ops = kept
    return removed


@dataclass(frozen=True)
class CsePass(Pass):
    """Common-subexpression elimination."""

    name: ClassVar[str] = "cse"
    summary: ClassVar[str] = "merge identical pure ops"

    def run(self, module: Module, ctx: PassContext) -> Module:
        merged = sum(merge(g) for g in module.graphs)
        ctx.count("cse.ops-merged", merged)
        return module

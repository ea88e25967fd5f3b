"""``dce``: remove ops whose results nothing uses, then tensor-table entries no op references.

Before::

    %a = const() {ref = @unused} : tensor<f32[4]>
    %y = relu(%x) : tensor<f32[4]>
    return(%y)

After: the ``const`` and ``tensor @unused`` are gone. ``return`` is always live, and so are tensors
marked ``role = "carried"`` (checkpoint tensors the graph does not read but the artifact must hold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qcompiler.ir.core import Graph, Module
from qcompiler.ir.symbols import is_carried, referenced_tensors
from qcompiler.passes.base import Pass, PassContext


def remove_dead_ops(g: Graph) -> int:
    live: set[int] = set()
    kept = []
    for op in reversed(g.ops):
        if op.name != "return" and not any(id(r) in live for r in op.results):
            continue
        kept.append(op)
        live.update(id(v) for v in op.operands)
    removed = len(g.ops) - len(kept)
    g.ops = list(reversed(kept))
    return removed


@dataclass(frozen=True)
class DcePass(Pass):
    """Dead-code elimination over ops and the tensor table."""

    name: ClassVar[str] = "dce"
    summary: ClassVar[str] = "remove unused ops and unreferenced tensors"

    def run(self, module: Module, ctx: PassContext) -> Module:
        removed = sum(remove_dead_ops(g) for g in module.graphs)
        used = referenced_tensors(module)
        dead = [name for name in module.tensors if name not in used and not is_carried(module, name)]
        for name in dead:
            del module.tensors[name]
        ctx.count("dce.ops-removed", removed)
        ctx.count("dce.tensors-removed", len(dead))
        return module

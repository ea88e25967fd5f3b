"""Small helpers for passes that rewrite graphs."""

from __future__ import annotations

from qcompiler.ir.core import Graph, Value


def replace_uses(g: Graph, old: Value, new: Value) -> int:
    """Point every use of ``old`` in ``g`` at ``new``; returns how many operands changed."""
    n = 0
    for op in g.ops:
        for i, v in enumerate(op.operands):
            if v is old:
                op.operands[i] = new
                n += 1
    return n

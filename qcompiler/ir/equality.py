"""Structural equality of modules: same tensors, graphs, ops, types, attributes and use-def edges,
regardless of comments, source locations, or the spelling of SSA names."""

from __future__ import annotations

from qcompiler.ir.core import Graph, Module, Value


def graphs_equal(a: Graph, b: Graph) -> bool:
    if a.name != b.name or len(a.args) != len(b.args) or len(a.ops) != len(b.ops):
        return False
    pairs: dict[int, int] = {}
    for x, y in zip(a.args, b.args, strict=True):
        if x.type != y.type:
            return False
        pairs[id(x)] = id(y)
    for p, q in zip(a.ops, b.ops, strict=True):
        if p.name != q.name or p.attrs != q.attrs or len(p.operands) != len(q.operands):
            return False
        if any(pairs.get(id(u)) != id(v) for u, v in zip(p.operands, q.operands, strict=True)):
            return False
        if not same_results(p.results, q.results, pairs):
            return False
    return True


def same_results(xs: list[Value], ys: list[Value], pairs: dict[int, int]) -> bool:
    if len(xs) != len(ys) or any(x.type != y.type for x, y in zip(xs, ys, strict=True)):
        return False
    pairs.update((id(x), id(y)) for x, y in zip(xs, ys, strict=True))
    return True


def modules_equal(a: Module, b: Module) -> bool:
    """True when ``a`` and ``b`` mean the same IR (trivia and value names aside)."""
    if a.name != b.name or a.attrs != b.attrs or list(a.tensors) != list(b.tensors):
        return False
    for name, da in a.tensors.items():
        db = b.tensors[name]
        if da.blob != db.blob or da.attrs != db.attrs:
            return False
    return len(a.graphs) == len(b.graphs) and all(graphs_equal(x, y) for x, y in zip(a.graphs, b.graphs, strict=True))

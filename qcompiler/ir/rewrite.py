"""Rewriting graphs: a ``Rewriter`` that keeps uses current while it replaces, erases and inserts ops,
and a pattern walker (``apply``) that offers every op to a list of patterns.

    rw = Rewriter(g)
    rw.replace(u, create_op("q.linear", [x, w], [u.result.type], result_names=[u.result.name]))
    rw.erase(dq)              # refused while anything still uses its results

    def fold(rw: Rewriter, op: Op) -> bool: ...   # True when it rewrote something
    apply(g, [fold])          # each op of g once, in program order

Every value's ``producer`` is the op that defines it, so a pattern reads producers from the values
(``dq.x.producer``, through the op's operand accessors) and users from ``rw.users(value)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from qcompiler.ir.core import Graph, Op, Value


class Rewriter:
    """Edits ``g`` in place; ``users(v)`` stays the ops that use ``v``, in program order."""

    def __init__(self, g: Graph) -> None:
        self.g = g
        self._users: dict[int, list[Op]] = g.users()
        self.removed: set[int] = set()
        """``id`` of every op replaced or erased so far."""
        self._where: dict[int, int] | None = None
        """``id`` of each op of ``g`` -> its index, made when first needed and kept while ops are only
        replaced in place (an insert or an erase moves the ops after it: made again)."""

    def users(self, v: Value) -> list[Op]:
        return list(self._users.get(id(v), []))

    def replace_uses(self, old: Value, new: Value) -> int:
        """Point every use of ``old`` at ``new``; returns how many operands changed."""
        n = 0
        for op in self._users.pop(id(old), []):
            for i, v in enumerate(op.operands):
                if v is old:
                    op.operands[i] = new
                    n += 1
            self._users.setdefault(id(new), []).append(op)
        self._sort(new)
        return n

    def replace(self, old: Op, new: Op) -> None:
        """Put ``new`` where ``old`` is; every use of ``old``'s results moves to ``new``'s (one result
        for one, in order)."""
        i = self.g.ops.index(old)
        self.g.ops[i] = new
        if self._where is not None:
            del self._where[id(old)]
            self._where[id(new)] = i
        self.removed.add(id(old))
        self._forget(old)
        self._use(new)
        for a, b in zip(old.results, new.results, strict=True):
            self.replace_uses(a, b)

    def insert_before(self, anchor: Op, new: Op) -> None:
        self.g.ops.insert(self.g.ops.index(anchor), new)
        self._where = None
        self._use(new)

    def erase(self, op: Op) -> None:
        """Remove ``op``, which nothing may still use (a ``ValueError`` names the op and a user)."""
        for r in op.results:
            left = self._users.get(id(r))
            if left:
                raise ValueError(f"cannot erase {op.describe()}: {left[0].describe()} still uses %{r.name}")
        self.g.ops.remove(op)
        self._where = None
        self.removed.add(id(op))
        self._forget(op)

    def _use(self, op: Op) -> None:
        for v in op.operands:
            self._users.setdefault(id(v), []).append(op)
            self._sort(v)

    def _forget(self, op: Op) -> None:
        for v in op.operands:
            users = self._users.get(id(v), [])
            if op in users:
                users.remove(op)

    def _sort(self, v: Value) -> None:
        users = self._users.get(id(v))
        if users and len(users) > 1:
            if self._where is None:
                self._where = {id(op): i for i, op in enumerate(self.g.ops)}
            where = self._where
            users.sort(key=lambda op: where.get(id(op), len(where)))


Pattern = Callable[[Rewriter, Op], bool]
"""``(rewriter, op) -> rewrote``: matches at ``op`` and rewrites through the rewriter, or returns False."""


def apply(g: Graph, patterns: Iterable[Pattern]) -> int:
    """Offer each op ``g`` holds now, in program order, to each pattern until one rewrites; returns
    how many rewrote. An op a pattern already replaced or erased is not offered, nor is an op a
    pattern made (one sweep: a pattern never meets its own output, so the walk always ends)."""
    rw, todo, n = Rewriter(g), list(patterns), 0
    for op in list(g.ops):
        if id(op) in rw.removed:
            continue
        for pattern in todo:
            if pattern(rw, op):
                n += 1
                break
    return n


def replace_uses(g: Graph, old: Value, new: Value) -> int:
    """Point every use of ``old`` in ``g`` at ``new``; returns how many operands changed (one-off
    edits; a pass that rewrites many ops keeps a ``Rewriter``)."""
    n = 0
    for op in g.ops:
        for i, v in enumerate(op.operands):
            if v is old:
                op.operands[i] = new
                n += 1
    return n

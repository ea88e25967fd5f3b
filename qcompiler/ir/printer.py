"""The textual IR printer. Its output is the canonical form: ``print(parse(t)) == t`` for canonical ``t``.

Layout: two-space indentation, one statement per line, tensor table before graphs, weights as
content-addressed handles (``blob<"sha256:…", "location">``), never their bytes. Comment and blank
lines read by the parser are kept with the statement they precede when ``keep_comments`` is true.
"""

from __future__ import annotations

import re

from qcompiler.ir.attrs import SymbolRef, format_attr_dict, format_string
from qcompiler.ir.core import Graph, Module, Op, TensorDecl, Value

_PLAIN_VALUE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.]*$")


def format_symbol(name: str) -> str:
    return str(SymbolRef(name))


class Printer:
    """Prints one module. Value names come from their ``name`` (made unique if needed)."""

    def __init__(self, keep_comments: bool = False) -> None:
        self.keep_comments = keep_comments
        self.lines: list[str] = []
        self.names: dict[int, str] = {}

    def comments(self, lines: list[str]) -> None:
        if self.keep_comments:
            self.lines.extend(lines)

    def module(self, m: Module) -> str:
        self.comments(m.comments)
        attrs = f" attributes {format_attr_dict(m.attrs)}" if m.attrs else ""
        self.lines.append(f"module {format_symbol(m.name)}{attrs} {{")
        for decl in m.tensors.values():
            self.tensor(decl)
        for g in m.graphs:
            self.graph(g)
        self.comments(m.end_comments)
        self.lines.append("}")
        self.comments(m.trailer)
        return "\n".join(self.lines) + "\n"

    def tensor(self, d: TensorDecl) -> None:
        self.comments(d.comments)
        b = d.blob
        attrs = f" {format_attr_dict(d.attrs)}" if d.attrs else ""
        blob = f"blob<{format_string('sha256:' + b.sha256)}, {format_string(b.location)}>"
        self.lines.append(f"  tensor {format_symbol(d.name)} : {d.type_str()} = {blob}{attrs}")

    def graph(self, g: Graph) -> None:
        self.comments(g.comments)
        self.names = {}
        taken: set[str] = set()
        for v in g.values():
            self.names[id(v)] = unique_name(v.name, taken)
        args = ", ".join(f"{self.value(a)}: {a.type}" for a in g.args)
        self.lines.append(f"  graph {format_symbol(g.name)}({args}) {{")
        for op in g.ops:
            self.comments(op.comments)
            self.lines.append("    " + self.op(op))
        self.comments(g.end_comments)
        self.lines.append("  }")

    def value(self, v: Value) -> str:
        return "%" + self.names.get(id(v), v.name or "<undefined>")

    def op(self, op: Op) -> str:
        lhs = ", ".join(self.value(r) for r in op.results)
        text = (lhs + " = " if lhs else "") + op.name
        text += "(" + ", ".join(self.value(v) for v in op.operands) + ")"
        if op.attrs:
            text += " " + format_attr_dict(op.attrs)
        if op.results:
            text += " : " + ", ".join(str(r.type) for r in op.results)
        return text


def unique_name(name: str, taken: set[str]) -> str:
    base = name if name and _PLAIN_VALUE.match(name) else ""
    if base and base not in taken:
        taken.add(base)
        return base
    i = 0
    while (candidate := f"{base}_{i}" if base else str(i)) in taken:
        i += 1
    taken.add(candidate)
    return candidate


def print_module(m: Module, keep_comments: bool = False) -> str:
    """The canonical text of ``m`` (with its comment lines when ``keep_comments``)."""
    return Printer(keep_comments).module(m)

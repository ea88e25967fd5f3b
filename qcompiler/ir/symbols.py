"""Which tensor-table entries a module's ops reference (through ``@name`` attributes, nested too)."""

from __future__ import annotations

from collections.abc import Iterator

from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.core import Module, Op


def refs_in(value: AttrValue) -> Iterator[str]:
    if isinstance(value, SymbolRef):
        yield value.name
    elif isinstance(value, list):
        for v in value:
            yield from refs_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from refs_in(v)


def op_refs(op: Op) -> set[str]:
    return {name for v in op.attrs.values() for name in refs_in(v)}


def referenced_tensors(m: Module) -> set[str]:
    return {name for op in m.ops() for name in op_refs(op)}

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


def is_carried(m: Module, name: str) -> bool:
    """A checkpoint tensor no op reads but the artifact must hold (``role = "carried"``)."""
    return m.tensors[name].attrs.get("role") == "carried"


def renamed(value: AttrValue, old: str, new: str) -> AttrValue:
    if isinstance(value, SymbolRef):
        return SymbolRef(new) if value.name == old else value
    if isinstance(value, list):
        return [renamed(v, old, new) for v in value]
    if isinstance(value, dict):
        return {k: renamed(v, old, new) for k, v in value.items()}
    return value


def rename_tensor(m: Module, old: str, new: str) -> None:
    """Rename tensor-table entry ``old`` to ``new`` (keeping table order) and every ``@old`` reference."""
    m.tensors = {(new if k == old else k): v for k, v in m.tensors.items()}
    m.tensors[new].name = new
    for op in m.ops():
        op.attrs = {k: renamed(v, old, new) for k, v in op.attrs.items()}

"""Build IR from Python: add tensors to the table and append ops with their result types.

b = Builder(Module("mlp", attrs={"provenance": {...}}))
g = b.graph("forward", x=DenseType(F32, ("?batch", 32)))
w = b.affine_weight("fc1", codes, scale, group=32)
y = b.op("q.linear", [g.args[0], w], DenseType(F32, ("?batch", 64)), name="y")
b.ret(y)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import put_array
from qcompiler.ir.core import Graph, Module, TensorDecl, Value, create_op
from qcompiler.ir.descriptor import rate_claim
from qcompiler.ir.dtypes import DTYPES, code_dtype
from qcompiler.ir.types import (
    Alphabet,
    CodeContract,
    DenseType,
    GroupSpec,
    QuantType,
    Slot,
    Type,
)


class Builder:
    """Appends to the last graph created with ``graph``."""

    def __init__(self, module: Module) -> None:
        self.module = module
        self.current: Graph | None = None

    def graph(self, name: str, **args: Type) -> Graph:
        g = Graph(name, [Value(n, t) for n, t in args.items()])
        self.module.graphs.append(g)
        self.current = g
        return g

    def tensor(self, name: str, arr: np.ndarray, dtype: str) -> SymbolRef:
        """Add ``arr`` to the tensor table (bytes kept in this process's blob store)."""
        self.module.tensors[name] = TensorDecl(name, put_array(arr, DTYPES[dtype]))
        return SymbolRef(name)

    def op(
        self,
        name: str,
        operands: list[Value],
        result: Type,
        attrs: dict[str, AttrValue] | None = None,
        *,
        out: str = "",
    ) -> Value:
        assert self.current is not None, "call graph() first"
        op = create_op(name, operands, [result], attrs, [out])
        self.current.ops.append(op)
        return op.result

    def ret(self, *values: Value) -> None:
        assert self.current is not None, "call graph() first"
        self.current.ops.append(create_op("return", list(values), []))

    def const(self, name: str, arr: np.ndarray, dtype: str = "f32") -> Value:
        ref = self.tensor(name, arr, dtype)
        return self.op(
            "const", [], DenseType(DTYPES[dtype], tuple(arr.shape)), {"ref": ref}, out=name.replace(".", "_")
        )

    def affine_weight(
        self,
        name: str,
        codes: np.ndarray,
        scale: np.ndarray,
        *,
        bits: int,
        group: int,
        req: str = "linear",
        zero: np.ndarray | None = None,
    ) -> Value:
        """A ``q.weight`` of family ``affine`` with signed ``bits``-bit codes, f16 scales (and u8/i8
        zero points when given), groups of ``group`` along axis 1, in the logical layout."""
        code = code_dtype(f"i{bits}")
        assert code is not None
        attrs: dict[str, AttrValue] = {"codes": self.tensor(f"{name}.codes", codes, code.container.name)}
        slots: list[Slot] = [("scale", DenseType(DTYPES["f16"], tuple(scale.shape)))]
        attrs["scale"] = self.tensor(f"{name}.scale", scale, "f16")
        if zero is not None:
            slots.append(("zero", DenseType(DTYPES["i8"], tuple(zero.shape))))
            attrs["zero"] = self.tensor(f"{name}.zero", zero, "i8")
        t = QuantType(
            family="affine",
            code=CodeContract(code, Alphabet.range(code.min, code.max)),
            expressed=DenseType(DTYPES["f32"], tuple(int(d) for d in codes.shape)),
            group=GroupSpec(axis=1, size=group),
            qparams=tuple(slots),
            req=req,
        )
        t = dataclasses.replace(t, rate=rate_claim(t, ("codes", *(n for n, _ in slots))))
        return self.op("q.weight", [], t, attrs, out=name.replace(".", "_"))

"""The lowering context: one exported program being turned into one QIR module.

It resolves placeholders to parameters/buffers/constants, maps torch types (with symbolic dims) to
QIR types, adds tensors to the table, and emits ops. Lowering functions (``lowerings.py``) only call
``value``/``emit``/``const_value``/``dim``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import fx
from torch.export import ExportedProgram

from qcompiler.errors import QcError
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import put_array
from qcompiler.ir.core import BlobRef, Graph, Module, TensorDecl, Value, create_op
from qcompiler.ir.dtypes import DTYPES, DType
from qcompiler.ir.types import DenseType, Dim

TORCH_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}


class UnsupportedError(QcError):
    """The source graph holds something the frontend cannot lower; names op, module path and source line."""


def where_from(node: fx.Node) -> str:
    """``module path (file:line)`` of a node, from export metadata."""
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else "<top>"
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [ln.strip() for ln in trace if ln.strip().startswith("File ")]
    return f"module {path or '<top>'}, {frames[-1] if frames else 'no source location'}"


def to_numpy(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """A detached CPU numpy copy of ``t`` plus its IR dtype name (bf16 as raw uint16)."""
    name = TORCH_DTYPES.get(t.dtype)
    if name is None:
        raise QcError(f"tensor dtype {t.dtype} has no QIR element type")
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), name
    return t.numpy(), name


@dataclass
class Lowering:
    """State of one lowering. ``symbols`` maps torch symbol names (``s27``) to QIR dim names."""

    ep: ExportedProgram
    module: Module
    symbols: dict[str, str]
    graph: Graph = field(default_factory=lambda: Graph("forward"))
    values: dict[fx.Node, Value] = field(default_factory=dict[fx.Node, Value])
    consts: dict[str, torch.Tensor] = field(default_factory=dict[str, torch.Tensor])
    """Placeholder name -> the tensor it stands for (parameters, buffers, lifted constants)."""
    const_names: dict[str, str] = field(default_factory=dict[str, str])
    """Placeholder name -> its fully qualified name in the model (the tensor-table name)."""
    effective: Mapping[str, torch.Tensor] = field(default_factory=dict[str, torch.Tensor])
    """Weight name -> the source library's own dequantized weight, when known before export."""
    sources: dict[str, str] = field(default_factory=dict[str, str])
    """Weight name -> where its quantization state came from (``torchao IntxUnpackedToInt8Tensor``)."""
    rewrites: dict[fx.Node, Any] = field(default_factory=dict[fx.Node, Any])
    tied: dict[str, str] = field(default_factory=dict[str, str])
    """Every other name of a buffer shared between modules -> the first name it was registered under
    (a quantized embedding table its tied output head reads too)."""
    dequantized: dict[tuple[str, ...], Value] = field(default_factory=dict[tuple[str, ...], Value])
    """A weight dequantize already lowered, by target and operands: a tied weight is lowered once."""
    lazy: dict[str, BlobRef] = field(default_factory=dict[str, BlobRef])
    """Tensor-table name -> where its bytes already are (a streamed source: the model holds no data)."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict[str, torch.Tensor])
    """Tensor-table name -> the real value of a buffer no checkpoint holds (the model's is fake)."""
    """Decisions made before lowering (e.g. recognised attention masks), by node."""

    # ------------------------------------------------------------------ types and dims

    def dim(self, d: Any) -> Dim:
        if isinstance(d, int):
            return d
        if isinstance(d, torch.SymInt):
            expr = str(d.node.expr)
            if expr.isdigit():
                return int(expr)
            name = self.symbols.get(expr)
            return f"?{name}" if name else "?"
        if isinstance(d, fx.Node):
            return self.dim(d.meta["val"])
        raise UnsupportedError(f"cannot read a dimension from {d!r}")

    def type_of(self, node: fx.Node) -> DenseType:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise UnsupportedError(f"node {node.name} ({node.target}) has no tensor value: {where_from(node)}")
        name = TORCH_DTYPES.get(val.dtype)
        if name is None:
            raise UnsupportedError(
                f"node {node.name} has dtype {val.dtype}, which QIR has no type for: {where_from(node)}"
            )
        return DenseType(DTYPES[name], tuple(self.dim(d) for d in val.shape))

    # ------------------------------------------------------------------ values

    def value(self, arg: Any) -> Value:
        if not isinstance(arg, fx.Node):
            raise UnsupportedError(f"expected a tensor operand, found {arg!r}")
        v = self.values.get(arg)
        if v is None and arg.name in self.consts:
            return self.const_value(arg)
        if v is None:
            raise UnsupportedError(f"operand {arg.name} was not lowered before its use")
        return v

    def add_tensor(self, name: str, t: torch.Tensor) -> SymbolRef:
        """Put ``t`` in the tensor table under ``name`` (made unique), bytes held in memory; a tensor
        without data (a streamed source's) takes the reference the source made for ``name``."""
        ref = self.lazy.get(name)
        if ref is not None and ref.shape != tuple(t.shape):
            raise UnsupportedError(
                f"tensor {name}: the source holds shape {list(ref.shape)}, the model {list(t.shape)}"
            )
        if ref is None:
            from qcompiler.frontend.skeleton import is_fake

            if is_fake(t):
                if name not in self.buffers:
                    raise UnsupportedError(f"tensor {name}: no source tensor and no computed value for it")
                t = self.buffers[name]
            arr, dtype = to_numpy(t)
            ref = put_array(arr, DTYPES[dtype])
        base, i = name, 1
        while name in self.module.tensors:
            name, i = f"{base}.{i}", i + 1
        self.module.tensors[name] = TensorDecl(name, ref)
        return SymbolRef(name)

    def const_value(self, node: fx.Node) -> Value:
        """A dense ``const`` for a parameter/buffer/constant placeholder (one table entry each)."""
        existing = self.values.get(node)
        if existing is not None:
            return existing
        t = self.consts[node.name]
        ref = self.add_tensor(self.const_names[node.name], t)
        decl = self.module.tensors[ref.name]
        ty = DenseType(decl.blob.dtype, decl.blob.shape)
        v = self.emit("const", [], ty, {"ref": ref}, name=node.name)
        traced = DTYPES[TORCH_DTYPES[t.dtype]]
        if traced != decl.blob.dtype:  # a source tensor kept in its dtype, widened where the graph reads it
            v = self.emit("cast", [v], DenseType(traced, decl.blob.shape), {"dtype": traced}, name=f"{node.name}_cast")
        self.values[node] = v
        return v

    def scalar(self, value: float | int | bool, dtype: DType) -> Value:
        v: AttrValue = float(value)
        return self.emit("full", [], DenseType(dtype, ()), {"value": v, "shape": []}, name="c")

    def emit(
        self,
        op: str,
        operands: list[Value],
        result: DenseType | Any,
        attrs: dict[str, AttrValue] | None = None,
        *,
        name: str = "",
    ) -> Value:
        new = create_op(op, operands, [result], attrs, [name])
        self.graph.ops.append(new)
        return new.result

    def emit_none(self, op: str, operands: list[Value]) -> None:
        self.graph.ops.append(create_op(op, operands, []))

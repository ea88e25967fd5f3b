"""The ONNX graph under construction: nodes, initializers, dims, and the op lowering registry."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qcompiler.errors import QcError
from qcompiler.ir.attrs import AttrValue
from qcompiler.ir.core import Graph, Module, Op, Value
from qcompiler.ir.types import DenseType, Dim

ONNX_DTYPES: dict[str, int] = {
    "f64": TensorProto.DOUBLE,
    "f32": TensorProto.FLOAT,
    "f16": TensorProto.FLOAT16,
    "bf16": TensorProto.BFLOAT16,
    "i64": TensorProto.INT64,
    "i32": TensorProto.INT32,
    "i16": TensorProto.INT16,
    "i8": TensorProto.INT8,
    "u8": TensorProto.UINT8,
    "bool": TensorProto.BOOL,
}


def tensor_of(arr: np.ndarray, name: str, dtype: str) -> TensorProto:
    """An initializer of IR dtype ``dtype`` from the IR's numpy container ``arr``: bf16 is held as raw
    16-bit words, which ``numpy_helper`` alone would declare UINT16 (and a Cast would then read the
    bits as integers)."""
    if dtype == "bf16":
        raw = np.ascontiguousarray(arr, dtype="<u2").tobytes()
        return helper.make_tensor(name, TensorProto.BFLOAT16, list(arr.shape), raw, raw=True)
    return numpy_helper.from_array(np.asarray(arr), name)


class LowerError(QcError):
    """A QIR op has no ONNX lowering, or its operands do not fit one."""


@dataclass
class OnnxBuilder:
    """Nodes and initializers of one ONNX graph under construction."""

    m: Module
    g: Graph
    nodes: list[onnx.NodeProto] = field(default_factory=list[onnx.NodeProto])
    initializers: list[TensorProto] = field(default_factory=list[TensorProto])
    names: dict[int, str] = field(default_factory=dict[int, str])
    dims: dict[str, str] = field(default_factory=dict[str, str])
    taken: set[str] = field(default_factory=set[str])
    weights: Any = None
    """The form's ``WeightForm`` (lowers ``q.*`` ops)."""
    kv: Any = None
    """A ``kv_cache.KvCache`` when building the variant with past/present key-values."""

    def fresh(self, hint: str) -> str:
        name, i = hint, 1
        while name in self.taken:
            name, i = f"{hint}_{i}", i + 1
        self.taken.add(name)
        return name

    def name_of(self, v: Value) -> str:
        return self.names[id(v)]

    def node(self, op_type: str, inputs: Sequence[str], hint: str, domain: str = "", **attrs: Any) -> str:
        """Append a node with one output, named from ``hint``."""
        out = self.fresh(hint)
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, domain=domain, **attrs))
        return out

    def constant(self, arr: np.ndarray, hint: str) -> str:
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def dim(self, d: Dim) -> str:
        """An int64 ``[1]`` tensor holding dim ``d``."""
        if isinstance(d, int):
            return self.constant(np.array([d], np.int64), "dim")
        if d not in self.dims:
            raise LowerError(f"dynamic dim {d} is not a dim of any graph input")
        return self.dims[d]

    def shape(self, dims: Sequence[AttrValue], hint: str) -> str:
        """An int64 shape vector: one constant when static, else a ``Concat`` of constants and input dims."""
        if all(isinstance(d, int) for d in dims):
            return self.constant(np.array(list(dims), np.int64), f"{hint}_shape")
        return self.node("Concat", [self.dim(d) for d in dims], f"{hint}_shape", axis=0)  # type: ignore[arg-type]

    def scalar(self, d: AttrValue, hint: str) -> str:
        if isinstance(d, int):
            return self.constant(np.array(d, np.int64), hint)
        axes = self.constant(np.array([0], np.int64), f"{hint}_axes")
        return self.node("Squeeze", [self.dim(d), axes], hint)  # type: ignore[arg-type]


Lowering = Callable[[OnnxBuilder, Op, list[str]], str]
LOWERINGS: dict[str, Lowering] = {}


def lowers(*names: str) -> Callable[[Lowering], Lowering]:
    def register(fn: Lowering) -> Lowering:
        for n in names:
            LOWERINGS[n] = fn
        return fn

    return register


def result_type(op: Op) -> DenseType:
    t = op.result.type
    if not isinstance(t, DenseType):
        raise LowerError(f"{op.describe()}: expected a dense result")
    return t


def result_type_of(v: Value) -> DenseType:
    if not isinstance(v.type, DenseType):
        raise LowerError(f"%{v.name}: expected a dense value")
    return v.type

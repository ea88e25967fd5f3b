"""QIR graph -> ONNX graph, one table entry per op (opset 21; ``MatMulNBits`` from ``com.microsoft``).

Dynamic dims stay dynamic: a QIR dim ``?seq`` becomes the graph input's ``dim_param`` ``seq``, and an
op whose attributes name it (``reshape {shape = [1, "?seq", 4, 16]}``, ``arange {end = "?seq"}``)
reads it at run time from ``Shape(input, start=j, end=j+1)``. Quantized weights are lowered by the
form's ``WeightForm`` (``weights.py``). An op without an entry fails, naming it.

| QIR | ONNX |
|---|---|
| ``add`` ``sub`` ``mul`` ``div`` ``pow`` | ``Add`` ``Sub`` ``Mul`` ``Div`` ``Pow`` |
| ``maximum`` ``minimum`` | ``Max`` ``Min`` |
| ``neg``, ``exp``, ``sqrt``, ``cos``, ``sin``, ``tanh``, ``erf``, ... | the op of the same meaning |
| ``rsqrt``, ``silu`` | ``Reciprocal(Sqrt)``, ``x * Sigmoid(x)`` |
| ``gelu`` | ``0.5 x (1 + Erf(x / sqrt 2))`` |
| ``reshape``/``expand``/``full`` | ``Reshape``/``Expand``/``ConstantOfShape`` with a shape vector |
| ``slice``, ``concat``, ``transpose``, ``cast`` | ``Slice``, ``Concat``, ``Transpose``, ``Cast`` |
| ``gather`` (torch.gather) | ``GatherElements`` |
| ``mean``/``sum`` | ``ReduceMean``/``ReduceSum`` |
| ``layer_norm`` | ``LayerNormalization`` |
| ``embedding`` | ``Gather(axis=0)`` |
| ``linear`` | ``MatMul(x, Transpose(W))`` (+ ``Add`` bias) |
| ``sdpa`` | GQA heads repeated, ``MatMul(q, k^T) * scale``, mask/causal ``Where``, ``Softmax``, ``MatMul(v)`` |
| ``matmul``, ``clamp`` | ``MatMul``, ``Clip`` |
| ``rms_norm``, ``rotary`` (half) | ``x / sqrt(mean(x^2) + eps) * g``, ``x cos + concat(-x2, x1) sin`` |
| ``q.linear``, ``q.embedding``, ``q.dequantize`` | the weight form's nodes (QDQ or MatMulNBits) |
"""

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


BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "pow": "Pow", "maximum": "Max", "minimum": "Min"}
UNARY = {
    "neg": "Neg",
    "exp": "Exp",
    "log": "Log",
    "sqrt": "Sqrt",
    "abs": "Abs",
    "relu": "Relu",
    "sigmoid": "Sigmoid",
    "tanh": "Tanh",
    "erf": "Erf",
    "cos": "Cos",
    "sin": "Sin",
}
for _qir, _onnx in BINARY.items():
    LOWERINGS[_qir] = lambda b, op, xs, t=_onnx: b.node(t, xs[:2], op.result.name)
for _qir, _onnx in UNARY.items():
    LOWERINGS[_qir] = lambda b, op, xs, t=_onnx: b.node(t, xs[:1], op.result.name)


@lowers("rsqrt")
def _rsqrt(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("Reciprocal", [b.node("Sqrt", xs, f"{op.result.name}_sqrt")], op.result.name)


@lowers("silu")
def _silu(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("Mul", [xs[0], b.node("Sigmoid", xs, f"{op.result.name}_sigmoid")], op.result.name)


@lowers("gelu")
def _gelu(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    if str(op.attrs.get("approximate", "none")) != "none":
        raise LowerError(f"{op.describe()}: only the exact (erf) GELU is lowered")
    n = op.result.name
    scaled = b.node("Mul", [xs[0], b.constant(np.array(1 / np.sqrt(2), np.float32), "inv_sqrt2")], f"{n}_s")
    one_plus = b.node(
        "Add", [b.node("Erf", [scaled], f"{n}_erf"), b.constant(np.array(1, np.float32), "one")], f"{n}_p"
    )
    half_x = b.node("Mul", [xs[0], b.constant(np.array(0.5, np.float32), "half")], f"{n}_h")
    return b.node("Mul", [half_x, one_plus], n)


@lowers("const")
def _const(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.weights.dense_initializer(b, str(op.attrs["ref"]).removeprefix("@"))


@lowers("full")
def _full(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    t = result_type(op)
    value = np.array([op.attrs["value"]], dtype=np.dtype(t.dtype.numpy)).reshape(1)
    dims = list(op.attrs.get("shape") or [])  # type: ignore[arg-type]
    if not dims:
        return b.constant(value.reshape(()), op.result.name)
    fill = numpy_helper.from_array(value, "value")
    return b.node("ConstantOfShape", [b.shape(dims, op.result.name)], op.result.name, value=fill)


@lowers("arange")
def _arange(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    t = result_type(op)
    if t.dtype.name != "i64":
        raise LowerError(f"{op.describe()}: only int64 ranges are lowered")
    start = b.scalar(op.attrs["start"], f"{op.result.name}_start")
    end = b.scalar(op.attrs["end"], f"{op.result.name}_end")
    step = b.scalar(op.attrs["step"], f"{op.result.name}_step")
    return b.node("Range", [start, end, step], op.result.name)


@lowers("reshape")
def _reshape(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("Reshape", [xs[0], b.shape(list(op.attrs["shape"]), op.result.name)], op.result.name)  # type: ignore[arg-type]


@lowers("expand")
def _expand(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("Expand", [xs[0], b.shape(list(op.attrs["shape"]), op.result.name)], op.result.name)  # type: ignore[arg-type]


@lowers("transpose")
def _transpose(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("Transpose", xs, op.result.name, perm=[int(p) for p in op.attrs["perm"]])  # type: ignore[union-attr]


@lowers("concat")
def _concat(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("Concat", xs, op.result.name, axis=int(op.attrs["axis"]))  # type: ignore[arg-type]


@lowers("cast")
def _cast(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("Cast", xs, op.result.name, to=ONNX_DTYPES[result_type(op).dtype.name])


@lowers("gather")
def _gather(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("GatherElements", xs, op.result.name, axis=int(op.attrs["axis"]))  # type: ignore[arg-type]


@lowers("slice")
def _slice(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    n = op.result.name
    start = b.constant(np.array([int(op.attrs["start"])], np.int64), f"{n}_start")  # type: ignore[arg-type]
    end = b.dim(op.attrs["end"])  # type: ignore[arg-type]
    axis = b.constant(np.array([int(op.attrs["axis"])], np.int64), f"{n}_axis")  # type: ignore[arg-type]
    step = b.constant(np.array([int(op.attrs["step"])], np.int64), f"{n}_step")  # type: ignore[arg-type]
    return b.node("Slice", [xs[0], start, end, axis, step], n)


def _reduce(kind: str) -> Lowering:
    def lower(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
        axes = b.constant(np.array([int(a) for a in op.attrs["axes"]], np.int64), f"{op.result.name}_axes")  # type: ignore[union-attr]
        return b.node(kind, [xs[0], axes], op.result.name, keepdims=int(bool(op.attrs.get("keepdim"))))

    return lower


LOWERINGS["mean"] = _reduce("ReduceMean")
LOWERINGS["sum"] = _reduce("ReduceSum")


@lowers("softmax")
def _softmax(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("Softmax", xs, op.result.name, axis=int(op.attrs["axis"]))  # type: ignore[arg-type]


@lowers("layer_norm")
def _layer_norm(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    eps = float(op.attrs["eps"])  # type: ignore[arg-type]
    return b.node("LayerNormalization", xs, op.result.name, axis=-1, epsilon=eps)


@lowers("embedding")
def _embedding(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("Gather", [xs[0], xs[1]], op.result.name, axis=0)


@lowers("linear")
def _linear(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    n = op.result.name
    wt = b.node("Transpose", [xs[1]], f"{n}_wT", perm=[1, 0])
    if len(xs) == 2:
        return b.node("MatMul", [xs[0], wt], n)
    return b.node("Add", [b.node("MatMul", [xs[0], wt], f"{n}_mm"), xs[2]], n)


@lowers("matmul")
def _matmul(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("MatMul", xs, op.result.name)


@lowers("clamp")
def _clamp(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    t = result_type(op)
    bounds = [
        b.constant(np.array(op.attrs[k], np.dtype(t.dtype.numpy)), f"{op.result.name}_{k}")
        if op.attrs.get(k) is not None
        else ""
        for k in ("min", "max")
    ]
    return b.node("Clip", [xs[0], *bounds], op.result.name)


@lowers("rms_norm")
def _rms_norm(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    n = op.result.name
    eps = b.constant(np.array(float(op.attrs["eps"]), np.float32), f"{n}_eps")  # type: ignore[arg-type]
    axes = b.constant(np.array([-1], np.int64), f"{n}_axes")
    mean = b.node("ReduceMean", [b.node("Mul", [xs[0], xs[0]], f"{n}_sq"), axes], f"{n}_mean", keepdims=1)
    inv = b.node("Reciprocal", [b.node("Sqrt", [b.node("Add", [mean, eps], f"{n}_e")], f"{n}_rms")], f"{n}_inv")
    y = b.node("Mul", [xs[0], inv], n if len(xs) == 1 else f"{n}_y")
    return y if len(xs) == 1 else b.node("Mul", [y, xs[1]], n)


@lowers("rotary")
def _rotary(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    if op.attrs.get("style") != "half":
        raise LowerError(f"{op.describe()}: only the rotate-half style is lowered (not {op.attrs.get('style')!r})")
    n = op.result.name
    half = int(result_type(op).shape[-1]) // 2  # type: ignore[arg-type]
    axis = b.constant(np.array([-1], np.int64), f"{n}_axis")
    bounds = ((half, "h"), (0, "0"), (1 << 62, "e"))
    cut, start, stop = (b.constant(np.array([v], np.int64), f"{n}_{w}") for v, w in bounds)
    x1 = b.node("Slice", [xs[0], start, cut, axis], f"{n}_x1")
    x2 = b.node("Slice", [xs[0], cut, stop, axis], f"{n}_x2")
    rotated = b.node("Concat", [b.node("Neg", [x2], f"{n}_neg"), x1], f"{n}_rot", axis=-1)
    return b.node("Add", [b.node("Mul", [xs[0], xs[1]], f"{n}_c"), b.node("Mul", [rotated, xs[2]], f"{n}_s")], n)


def repeat_heads(b: OnnxBuilder, x: str, rep: int, heads: int, head_dim: int, hint: str) -> str:
    """``[B, Hkv, T, D]`` -> ``[B, Hkv * rep, T, D]``, each key/value head repeated ``rep`` times (GQA)."""
    if rep == 1:
        return x
    axes = b.constant(np.array([2], np.int64), f"{hint}_axes")
    ones = b.constant(np.array([1, 1, rep, 1, 1], np.int64), f"{hint}_rep")
    expanded = b.node("Expand", [b.node("Unsqueeze", [x, axes], f"{hint}_u"), ones], f"{hint}_e")
    shape = b.constant(np.array([0, heads, -1, head_dim], np.int64), f"{hint}_shape")
    return b.node("Reshape", [expanded, shape], f"{hint}_r")


@lowers("sdpa")
def _sdpa(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    q_t, k_t = (result_type_of(v_) for v_ in op.operands[:2])
    heads, kv_heads, head_dim = q_t.shape[1], k_t.shape[1], k_t.shape[3]
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and isinstance(head_dim, int)):
        raise LowerError(f"{op.describe()}: heads and head_dim must be static")
    k = repeat_heads(b, xs[1], heads // kv_heads, heads, head_dim, f"{op.result.name}_krep")
    v = repeat_heads(b, xs[2], heads // kv_heads, heads, head_dim, f"{op.result.name}_vrep")
    mask = xs[3] if len(xs) > 3 else None
    mask_bool = len(xs) > 3 and result_type_of(op.operands[3]).dtype.name == "bool"
    lengths = (b.dim(q_t.shape[2]), b.dim(k_t.shape[2])) if op.attrs.get("causal") else None
    return attention(b, op, xs[0], k, v, mask, mask_bool, lengths)


def attention(
    b: OnnxBuilder,
    op: Op,
    q: str,
    k: str,
    v: str,
    mask: str | None,
    mask_bool: bool,
    lengths: tuple[str, str] | None,
) -> str:
    """``softmax(q k^T * scale + mask) v``; ``lengths`` (int64 ``[1]`` query and key lengths) makes it
    causal, the last query row seeing every key (keys beyond the queries are a cache before them)."""
    n = op.result.name
    q_t = result_type_of(op.operands[0])
    scale = op.attrs.get("scale")
    scale_f = float(scale) if scale is not None else 1.0 / float(np.sqrt(int(q_t.shape[-1])))  # type: ignore[arg-type]
    scores = b.node("MatMul", [q, b.node("Transpose", [k], f"{n}_kT", perm=[0, 1, 3, 2])], f"{n}_qk")
    scores = b.node("Mul", [scores, b.constant(np.array(scale_f, np.float32), f"{n}_scale")], f"{n}_scores")
    neg_inf = b.constant(np.array(-np.inf, np.float32), f"{n}_neg_inf")
    if mask is not None:
        scores = b.node(
            "Where" if mask_bool else "Add", [mask, scores, neg_inf] if mask_bool else [scores, mask], f"{n}_m"
        )
    if lengths is not None:
        ones = b.node(
            "ConstantOfShape",
            [b.node("Concat", list(lengths), f"{n}_sq_sk", axis=0)],
            f"{n}_ones",
            value=numpy_helper.from_array(np.array([1], np.int64), "value"),
        )
        axes = b.constant(np.array([0], np.int64), f"{n}_axes")
        sk, sq = (
            b.node("Squeeze", [d, axes], f"{n}_{w}") for d, w in zip(reversed(lengths), ("sk", "sq"), strict=True)
        )
        diag = b.node("Sub", [sk, sq], f"{n}_diag")
        tri = b.node("Cast", [b.node("Trilu", [ones, diag], f"{n}_tri", upper=0)], f"{n}_keep", to=TensorProto.BOOL)
        scores = b.node("Where", [tri, scores, neg_inf], f"{n}_causal")
    probs = b.node("Softmax", [scores], f"{n}_probs", axis=-1)
    return b.node("MatMul", [probs, v], n)


def result_type_of(v: Value) -> DenseType:
    if not isinstance(v.type, DenseType):
        raise LowerError(f"%{v.name}: expected a dense value")
    return v.type


def lower_graph(b: OnnxBuilder) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    """Lower ``b.g`` into ``b``'s nodes; returns the ONNX graph inputs and outputs."""
    inputs: list[onnx.ValueInfoProto] = []
    for a in b.g.args:
        t = result_type_of(a)
        b.taken.add(a.name)
        b.names[id(a)] = a.name
        shape = [d if isinstance(d, int) else d.removeprefix("?") for d in t.shape]
        inputs.append(helper.make_tensor_value_info(a.name, ONNX_DTYPES[t.dtype.name], shape))
        for j, d in enumerate(t.shape):
            if isinstance(d, str) and d not in b.dims:
                b.dims[d] = b.node("Shape", [a.name], f"dim_{d.removeprefix('?')}", start=j, end=j + 1)
    outputs: list[onnx.ValueInfoProto] = []
    for op in b.g.ops:
        xs = [b.name_of(v) for v in op.operands]
        if op.name == "return":
            for i, (v, x) in enumerate(zip(op.operands, xs, strict=True)):
                t = result_type_of(v)
                out = output_name(b.m, i, len(xs))
                b.nodes.append(helper.make_node("Identity", [x], [out], name=out))
                shape = [d if isinstance(d, int) else d.removeprefix("?") for d in t.shape]
                outputs.append(helper.make_tensor_value_info(out, ONNX_DTYPES[t.dtype.name], shape))
            break
        hook = b.kv.lowering(op) if b.kv is not None else None
        fn = hook or LOWERINGS.get(op.name) or b.weights.lowering(op.name)
        if fn is None:
            raise LowerError(
                f"{op.describe()}: no ONNX lowering for '{op.name}' (known: {', '.join(sorted(LOWERINGS))})"
            )
        if op.results:
            b.names[id(op.result)] = fn(b, op, xs)
    if b.kv is not None:
        inputs += b.kv.graph_inputs()
        outputs += b.kv.graph_outputs(b)
    prune(b, [o.name for o in outputs])
    return inputs, outputs


def prune(b: OnnxBuilder, outputs: list[str]) -> None:
    """Drop nodes no output depends on, and initializers no kept node reads."""
    made_by = {o: n for n in b.nodes for o in n.output}
    live: set[str] = set()
    stack = list(outputs)
    while stack:
        name = stack.pop()
        node = made_by.get(name)
        if node is None or node.name in live:
            continue
        live.add(node.name)
        stack.extend(i for i in node.input if i)
    b.nodes = [n for n in b.nodes if n.name in live]
    used = {i for n in b.nodes for i in n.input}
    b.initializers = [t for t in b.initializers if t.name in used]


OUTPUT_NAMES = {"CausalLMLogits": ("logits",), "EncoderHidden": ("last_hidden_state",)}
"""The capture wrapper (``provenance.model``) -> names of the graph's outputs."""


def output_name(m: Module, i: int, count: int) -> str:
    prov = m.attrs.get("provenance")
    wrapper = str(prov.get("model", "")) if isinstance(prov, dict) else ""
    names = OUTPUT_NAMES.get(wrapper, ())
    return names[i] if i < len(names) and count == len(names) else f"output_{i}"

"""ONNX lowerings of QIR's elementwise, shape, reduction, normalisation and contraction ops (see ``lower.py``)."""

from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper

from qcompiler.backends.onnx.builder import (
    LOWERINGS,
    ONNX_DTYPES,
    LowerError,
    Lowering,
    OnnxBuilder,
    lowers,
    result_type,
)
from qcompiler.ir.core import Op, narrow
from qcompiler.ir.ops.dense import Concat, Const, LayerNorm, Reshape, RmsNorm, Slice, Softmax, Transpose
from qcompiler.ir.ops.tensor import Arange, Expand, Gather, Reduce, TopkMask

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
ONNX_NUMPY = {"f32": np.float32, "f16": np.float16, "f64": np.float64}
"""Float dtypes a ``topk_mask`` may compute in -> numpy's (its zeros' ``ConstantOfShape`` value)."""
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
    """``0.5 x (1 + erf(x / sqrt 2))``, or with ``approximate = "tanh"`` (Gemma's GeGLU, GPT-2)
    ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``, torch's two formulas."""
    approx = str(op.attrs.get("approximate", "none"))
    if approx not in ("none", "tanh"):
        raise LowerError(f"{op.describe()}: GELU approximation {approx!r} is not lowered (none and tanh are)")
    n, x = op.result.name, xs[0]
    if approx == "none":
        scaled = b.node("Mul", [x, b.constant(np.array(1 / np.sqrt(2), np.float32), "inv_sqrt2")], f"{n}_s")
        inner = b.node("Erf", [scaled], f"{n}_erf")
    else:
        cube = b.node("Mul", [b.node("Mul", [x, x], f"{n}_x2"), x], f"{n}_x3")
        poly = b.node(
            "Add",
            [x, b.node("Mul", [cube, b.constant(np.array(0.044715, np.float32), "gelu_c")], f"{n}_c")],
            f"{n}_poly",
        )
        k = b.constant(np.array(np.sqrt(2 / np.pi), np.float32), "sqrt_2_over_pi")
        inner = b.node("Tanh", [b.node("Mul", [poly, k], f"{n}_k")], f"{n}_tanh")
    one_plus = b.node("Add", [inner, b.constant(np.array(1, np.float32), "one")], f"{n}_p")
    half_x = b.node("Mul", [x, b.constant(np.array(0.5, np.float32), "half")], f"{n}_h")
    return b.node("Mul", [half_x, one_plus], n)


@lowers("const")
def _const(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.weights.dense_initializer(b, str(narrow(op, Const).ref).removeprefix("@"))


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
    r = narrow(op, Arange)
    start = b.scalar(r.start, f"{op.result.name}_start")
    end = b.scalar(r.end, f"{op.result.name}_end")
    step = b.scalar(r.step, f"{op.result.name}_step")
    return b.node("Range", [start, end, step], op.result.name)


@lowers("reshape")
def _reshape(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("Reshape", [xs[0], b.shape(list(narrow(op, Reshape).shape), op.result.name)], op.result.name)


@lowers("expand")
def _expand(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("Expand", [xs[0], b.shape(list(narrow(op, Expand).shape), op.result.name)], op.result.name)


@lowers("transpose")
def _transpose(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    perm = narrow(op, Transpose).perm
    return b.node("Transpose", xs, op.result.name, perm=[int(p) for p in perm])  # type: ignore[arg-type]


@lowers("concat")
def _concat(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("Concat", xs, op.result.name, axis=narrow(op, Concat).axis)


@lowers("cast")
def _cast(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("Cast", xs, op.result.name, to=ONNX_DTYPES[result_type(op).dtype.name])


@lowers("gather")
def _gather(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("GatherElements", xs, op.result.name, axis=narrow(op, Gather).axis)


@lowers("slice")
def _slice(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    n, s = op.result.name, narrow(op, Slice)
    start = b.constant(np.array([s.start], np.int64), f"{n}_start")
    end = b.dim(s.end)
    axis = b.constant(np.array([s.axis], np.int64), f"{n}_axis")
    step = b.constant(np.array([s.step], np.int64), f"{n}_step")
    return b.node("Slice", [xs[0], start, end, axis, step], n)


def _reduce(kind: str) -> Lowering:
    def lower(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
        listed = narrow(op, Reduce).axes
        axes = b.constant(np.array([int(a) for a in listed], np.int64), f"{op.result.name}_axes")  # type: ignore[arg-type]
        return b.node(kind, [xs[0], axes], op.result.name, keepdims=int(bool(op.attrs.get("keepdim"))))

    return lower


LOWERINGS["mean"] = _reduce("ReduceMean")
LOWERINGS["sum"] = _reduce("ReduceSum")


@lowers("softmax")
def _softmax(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    return b.node("Softmax", xs, op.result.name, axis=narrow(op, Softmax).axis)


@lowers("topk_mask")
def _topk_mask(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    """``TopK`` along the last axis, its values scattered onto zeros (``ScatterElements``)."""
    n = op.result.name
    values, index = b.fresh(f"{n}_values"), b.fresh(f"{n}_index")
    k = b.constant(np.array([narrow(op, TopkMask).k], np.int64), f"{n}_k")
    b.nodes.append(helper.make_node("TopK", [xs[0], k], [values, index], name=values, axis=-1, largest=1, sorted=1))
    zero = numpy_helper.from_array(np.zeros(1, ONNX_NUMPY[result_type(op).dtype.name]), f"{n}_zero")
    zeros = b.node("ConstantOfShape", [b.node("Shape", xs[:1], f"{n}_shape")], f"{n}_zeros", value=zero)
    return b.node("ScatterElements", [zeros, index, values], n, axis=-1)


@lowers("layer_norm")
def _layer_norm(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    eps = narrow(op, LayerNorm).eps
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
    eps = b.constant(np.array(narrow(op, RmsNorm).eps, np.float32), f"{n}_eps")
    axes = b.constant(np.array([-1], np.int64), f"{n}_axes")
    mean = b.node("ReduceMean", [b.node("Mul", [xs[0], xs[0]], f"{n}_sq"), axes], f"{n}_mean", keepdims=1)
    inv = b.node("Reciprocal", [b.node("Sqrt", [b.node("Add", [mean, eps], f"{n}_e")], f"{n}_rms")], f"{n}_inv")
    y = b.node("Mul", [xs[0], inv], n if len(xs) == 1 else f"{n}_y")
    return y if len(xs) == 1 else b.node("Mul", [y, xs[1]], n)

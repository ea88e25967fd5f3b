"""ATen -> QIR, one small function per op family, registered in ``LOWERINGS`` by op overload.

Each lowering reads the node's args, asks the context for operand values and the result type
(symbolic dims become ``?name``), and emits QIR. Identity-like nodes (clone, alias, dropout in
eval, same-dtype copies) map to their input. Anything not in the table stops the compile.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from qcompiler.frontend.context import Lowering, UnsupportedError, where_from
from qcompiler.ir.attrs import AttrValue
from qcompiler.ir.core import Value
from qcompiler.ir.types import DenseType
from qcompiler.quant import experts

aten = torch.ops.aten
Lower = Callable[[Lowering, fx.Node], Value | None]
LOWERINGS: dict[Any, Lower] = {}
DROPPED: set[Any] = {aten._assert_tensor_metadata.default, aten.sym_size.int}
"""Side-effect-only or shape-only nodes, dropped knowingly (sizes become ``?name`` dims)."""


def lowers(*targets: Any) -> Callable[[Lower], Lower]:
    def register(fn: Lower) -> Lower:
        for t in targets:
            LOWERINGS[t] = fn
        return fn

    return register


def operand(lx: Lowering, arg: Any, dtype: DenseType) -> Value:
    """A tensor operand, or a Python scalar as a ``full`` of the result dtype; cast to that dtype."""
    if isinstance(arg, fx.Node):
        v = lx.value(arg)
        if isinstance(v.type, DenseType) and v.type.dtype != dtype.dtype:
            v = lx.emit(
                "cast", [v], DenseType(dtype.dtype, v.type.shape), {"dtype": dtype.dtype}, name=f"{arg.name}_cast"
            )
        return v
    if isinstance(arg, bool | int | float):
        return lx.scalar(arg, dtype.dtype)
    raise UnsupportedError(f"unsupported operand {arg!r}")


BINARY: dict[Any, str] = {
    aten.add.Tensor: "add",
    aten.sub.Tensor: "sub",
    aten.mul.Tensor: "mul",
    aten.div.Tensor: "div",
    aten.pow.Tensor_Scalar: "pow",
    aten.pow.Tensor_Tensor: "pow",
    aten.maximum.default: "maximum",
    aten.minimum.default: "minimum",
}


@lowers(*BINARY)
def _binary(lx: Lowering, n: fx.Node) -> Value:
    if n.kwargs.get("alpha", 1) != 1:
        raise UnsupportedError(f"{n.target} with alpha != 1: {where_from(n)}")
    out = lx.type_of(n)
    a, b = (operand(lx, x, out) for x in n.args[:2])
    return lx.emit(BINARY[n.target], [a, b], out, name=n.name)


UNARY: dict[Any, str] = {
    aten.neg.default: "neg",
    aten.exp.default: "exp",
    aten.log.default: "log",
    aten.sqrt.default: "sqrt",
    aten.rsqrt.default: "rsqrt",
    aten.abs.default: "abs",
    aten.relu.default: "relu",
    aten.silu.default: "silu",
    aten.sigmoid.default: "sigmoid",
    aten.tanh.default: "tanh",
    aten.erf.default: "erf",
    aten.cos.default: "cos",
    aten.sin.default: "sin",
}


@lowers(*UNARY)
def _unary(lx: Lowering, n: fx.Node) -> Value:
    return lx.emit(UNARY[n.target], [lx.value(n.args[0])], lx.type_of(n), name=n.name)


@lowers(aten.gelu.default)
def _gelu(lx: Lowering, n: fx.Node) -> Value:
    approx = str(n.kwargs.get("approximate", "none"))
    return lx.emit("gelu", [lx.value(n.args[0])], lx.type_of(n), {"approximate": approx}, name=n.name)


@lowers(aten.clone.default, aten.alias.default, aten.contiguous.default, aten.dropout.default, aten.detach.default)
def _identity(lx: Lowering, n: fx.Node) -> Value:
    return lx.value(n.args[0])


@lowers(aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.type_as.default)
def _to(lx: Lowering, n: fx.Node) -> Value:
    """A dtype change (the exported graph's output dtype says which), or nothing: every value is on
    the CPU, strided, and a graph without mutation cannot tell a copy from an alias. ``type_as``
    takes the dtype of its second operand, which the result's type already states."""
    x, out = lx.value(n.args[0]), lx.type_of(n)
    if isinstance(x.type, DenseType) and x.type.dtype == out.dtype:
        return x
    return lx.emit("cast", [x], out, {"dtype": out.dtype}, name=n.name)


def shape_attr(lx: Lowering, n: fx.Node) -> list[AttrValue]:
    return [d if isinstance(d, int) else str(d) for d in lx.type_of(n).shape]


@lowers(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim)
def _reshape(lx: Lowering, n: fx.Node) -> Value:
    x = lx.value(n.args[0])
    if flattened_for_addmm(lx, n, x):
        return x  # addmm takes the rows unflattened: ``linear`` maps every leading dim alike
    return lx.emit("reshape", [x], lx.type_of(n), {"shape": shape_attr(lx, n)}, name=n.name)


def flattened_for_addmm(lx: Lowering, n: fx.Node, x: Value) -> bool:
    """Whether ``n`` only flattens ``x``'s leading dims into one row dim QIR cannot name (``?batch *
    ?seq``) for ``addmm`` (``Conv1D``: ``view(x, [-1, K])``), each user taking it as its rows."""
    out = lx.type_of(n)
    if out.rank != 2 or "?" not in out.shape or not isinstance(x.type, DenseType) or x.type.rank < 2:
        return False
    users = list(n.users)
    rows = all(u.target == aten.addmm.default and u.args[1] is n and n not in (u.args[0], u.args[2]) for u in users)
    return bool(users) and rows and x.type.shape[-1] == out.shape[-1]


@lowers(aten.expand.default)
def _expand(lx: Lowering, n: fx.Node) -> Value:
    return lx.emit("expand", [lx.value(n.args[0])], lx.type_of(n), {"shape": shape_attr(lx, n)}, name=n.name)


@lowers(aten.transpose.int, aten.permute.default, aten.t.default)
def _transpose(lx: Lowering, n: fx.Node) -> Value:
    x = lx.value(n.args[0])
    rank = len(lx.type_of(n).shape)
    perm = list(range(rank))
    if n.target == aten.permute.default:
        perm = [int(p) % rank for p in n.args[1]]  # type: ignore[union-attr]
    else:
        a, b = (int(n.args[1]) % rank, int(n.args[2]) % rank) if n.target == aten.transpose.int else (0, 1)  # type: ignore[arg-type]
        perm[a], perm[b] = perm[b], perm[a]
    return lx.emit("transpose", [x], lx.type_of(n), {"perm": list[AttrValue](perm)}, name=n.name)


@lowers(aten.slice.Tensor)
def _slice(lx: Lowering, n: fx.Node) -> Value:
    x = lx.value(n.args[0])
    defaults: list[Any] = [0, None, None, 1]
    given: list[Any] = list(n.args[1:])
    axis, start, end, step = (given + defaults[len(given) :])[:4]
    end_attr: AttrValue = 2**63 - 1 if end is None else (end if isinstance(end, int) else str(lx.dim(end)))
    attrs: dict[str, AttrValue] = {"axis": int(axis), "start": int(start or 0), "end": end_attr, "step": int(step or 1)}  # type: ignore[arg-type]
    return lx.emit("slice", [x], lx.type_of(n), attrs, name=n.name)


SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
"""Multi-output views: each part is picked by an ``operator.getitem`` node, which becomes a ``slice``."""


def split_parts(lx: Lowering, n: fx.Node) -> tuple[int, list[tuple[int, int]]]:
    """(axis, [start, end) of each part) of a split or chunk node, read from the parts' traced shapes.
    The split axis must have a static size: a part whose bounds follow ``?seq`` has no fixed slice."""
    x = n.args[0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    parts = n.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(parts, list | tuple):
        raise UnsupportedError(f"{n.target} ({n.name}) has no traced input or parts: {where_from(n)}")
    axis = int(n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)) % val.dim()  # type: ignore[arg-type]
    sizes = [p.shape[axis] for p in parts if isinstance(p, torch.Tensor)]  # pyright: ignore[reportUnknownVariableType, reportUnknownMemberType]
    if any(isinstance(d, torch.SymInt) for d in [val.shape[axis], *sizes]):
        raise UnsupportedError(
            f"{n.target} ({n.name}) along dim {axis} of dynamic size {lx.dim(val.shape[axis])}: only a static axis "
            f"can be split into fixed slices: {where_from(n)}"
        )
    bounds, start = list[tuple[int, int]](), 0
    for size in sizes:
        bounds.append((start, start + int(size)))
        start += int(size)
    return axis, bounds


@lowers(*SPLITS)
def _split(lx: Lowering, n: fx.Node) -> None:
    """Nothing to emit: checks the split (a static axis); its ``getitem`` users each emit a slice."""
    split_parts(lx, n)


@lowers(operator.getitem)
def _getitem(lx: Lowering, n: fx.Node) -> Value:
    """Part ``i`` of a split: ``slice {axis, start, end, step = 1}`` of the split's input."""
    src, index = n.args[0], n.args[1]
    if not isinstance(src, fx.Node) or src.target not in SPLITS or not isinstance(index, int):
        producer = src.target if isinstance(src, fx.Node) else src
        raise UnsupportedError(f"getitem of {producer} ({n.name}), not of a split or chunk: {where_from(n)}")
    axis, bounds = split_parts(lx, src)
    start, end = bounds[index]
    attrs: dict[str, AttrValue] = {"axis": axis, "start": start, "end": end, "step": 1}
    return lx.emit("slice", [lx.value(src.args[0])], lx.type_of(n), attrs, name=n.name)


@lowers(aten.select.int)
def _select(lx: Lowering, n: fx.Node) -> Value:
    x, axis, index = lx.value(n.args[0]), int(n.args[1]), int(n.args[2])  # type: ignore[arg-type]
    assert isinstance(x.type, DenseType)
    axis %= x.type.rank
    shape = list(x.type.shape)
    shape[axis] = 1
    attrs: dict[str, AttrValue] = {
        "axis": axis,
        "start": index,
        "end": index + 1 if index != -1 else 2**63 - 1,
        "step": 1,
    }
    sliced = lx.emit("slice", [x], DenseType(x.type.dtype, tuple(shape)), attrs, name=f"{n.name}_slice")
    return lx.emit("reshape", [sliced], lx.type_of(n), {"shape": shape_attr(lx, n)}, name=n.name)


@lowers(aten.cat.default)
def _cat(lx: Lowering, n: fx.Node) -> Value:
    xs = [lx.value(a) for a in n.args[0]]  # type: ignore[union-attr]
    axis = int(n.args[1]) if len(n.args) > 1 else 0  # type: ignore[arg-type]
    return lx.emit("concat", xs, lx.type_of(n), {"axis": axis}, name=n.name)


@lowers(aten.mean.dim, aten.sum.dim_IntList)
def _reduce(lx: Lowering, n: fx.Node) -> Value:
    args: list[Any] = list(n.args)
    axes: list[AttrValue] = [int(a) for a in args[1]]
    keep = bool(args[2]) if len(args) > 2 else bool(n.kwargs.get("keepdim", False))
    op = "mean" if n.target == aten.mean.dim else "sum"
    return lx.emit(op, [lx.value(args[0])], lx.type_of(n), {"axes": axes, "keepdim": keep}, name=n.name)


@lowers(aten.arange.default, aten.arange.start, aten.arange.start_step)
def _arange(lx: Lowering, n: fx.Node) -> Value:
    args: list[Any] = list(n.args)
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], args[2] if len(args) > 2 else 1)
    end_attr: AttrValue = end if isinstance(end, int) else str(lx.dim(end))
    return lx.emit("arange", [], lx.type_of(n), {"start": int(start), "end": end_attr, "step": int(step)}, name=n.name)  # type: ignore[arg-type]


@lowers(aten.gather.default)
def _gather(lx: Lowering, n: fx.Node) -> Value:
    x, axis, index = lx.value(n.args[0]), int(n.args[1]), lx.value(n.args[2])  # type: ignore[arg-type]
    return lx.emit("gather", [x, index], lx.type_of(n), {"axis": axis}, name=n.name)


@lowers(aten.clamp.default, aten.clamp_min.default)
def _clamp(lx: Lowering, n: fx.Node) -> Value:
    attrs: dict[str, AttrValue] = {}
    args: list[Any] = list(n.args)
    kwargs: dict[str, Any] = dict(n.kwargs)
    lo = args[1] if len(args) > 1 else kwargs.get("min")
    hi = args[2] if len(args) > 2 and n.target == aten.clamp.default else kwargs.get("max")
    if lo is not None:
        attrs["min"] = float(lo)
    if hi is not None:
        attrs["max"] = float(hi)
    return lx.emit("clamp", [lx.value(args[0])], lx.type_of(n), attrs, name=n.name)


@lowers(aten._softmax.default, aten.softmax.int)
def _softmax(lx: Lowering, n: fx.Node) -> Value:
    return lx.emit("softmax", [lx.value(n.args[0])], lx.type_of(n), {"axis": int(n.args[1])}, name=n.name)  # type: ignore[arg-type]


@lowers(experts.topk_mask._opoverload)  # pyright: ignore[reportPrivateUsage]
def _topk_mask(lx: Lowering, n: fx.Node) -> Value:
    """A MoE router's dense top-k weights (``quant/experts.py``): ``topk_mask {k}``."""
    return lx.emit("topk_mask", [lx.value(n.args[0])], lx.type_of(n), {"k": int(n.args[1])}, name=n.name)  # type: ignore[arg-type]


@lowers(aten.linear.default)
def _linear(lx: Lowering, n: fx.Node) -> Value:
    ops = [lx.value(a) for a in n.args[:3] if a is not None]
    return lx.emit("linear", ops, lx.type_of(n), name=n.name)


@lowers(aten.addmm.default)
def _addmm(lx: Lowering, n: fx.Node) -> Value:
    """``addmm(bias, x, w)`` = ``x @ w + bias`` with ``w`` as ``[K, N]`` (transformers' ``Conv1D``,
    GPT-2's projections): ``linear(x, transpose(w), bias)``, the weight kept in its source orientation
    in the tensor table (a target that wants it ``[N, K]`` writes the transpose: a pure permutation)."""
    if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
        raise UnsupportedError(f"addmm with beta or alpha != 1: {where_from(n)}")
    bias, x, w = (lx.value(a) for a in n.args[:3])
    assert isinstance(w.type, DenseType)
    assert isinstance(x.type, DenseType)
    k, cols = w.type.shape
    wt = lx.emit("transpose", [w], DenseType(w.type.dtype, (cols, k)), {"perm": [1, 0]}, name=f"{n.name}_w")
    out = DenseType(lx.type_of(n).dtype, (*x.type.shape[:-1], cols))  # x's rows as they were before the view
    return lx.emit("linear", [x, wt, bias], out, name=n.name)


@lowers(aten.matmul.default, aten.bmm.default, aten.mm.default)
def _matmul(lx: Lowering, n: fx.Node) -> Value:
    return lx.emit("matmul", [lx.value(n.args[0]), lx.value(n.args[1])], lx.type_of(n), name=n.name)


@lowers(aten.embedding.default)
def _embedding(lx: Lowering, n: fx.Node) -> Value:
    return lx.emit("embedding", [lx.value(n.args[0]), lx.value(n.args[1])], lx.type_of(n), name=n.name)


@lowers(aten.layer_norm.default)
def _layer_norm(lx: Lowering, n: fx.Node) -> Value:
    x, shape = lx.value(n.args[0]), list(n.args[1])  # type: ignore[arg-type]
    if len(shape) != 1:
        raise UnsupportedError(f"layer_norm over {len(shape)} dims (only the last dim is supported): {where_from(n)}")
    params = [lx.value(a) for a in n.args[2:4] if a is not None]
    eps = float(n.args[4]) if len(n.args) > 4 else 1e-05  # type: ignore[arg-type]
    return lx.emit("layer_norm", [x, *params], lx.type_of(n), {"eps": eps}, name=n.name)


__all__ = ["DROPPED", "LOWERINGS", "SPLITS", "lowers"]

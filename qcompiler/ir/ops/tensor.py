"""Constructors, reductions and indexing ops that real exported graphs contain (rotary tables,
position ids, norms written out, GQA head expansion).

Dynamic sizes are named by their symbol (``"?seq"``): a runtime binds every ``?name`` from the
shapes of the graph's inputs, so attributes may use them directly.
"""

from __future__ import annotations

from typing import ClassVar

from qcompiler.ir.attrs import AttrValue
from qcompiler.ir.core import Module, Op, TypeKind, attr, dim_attr, operand, optional_attr
from qcompiler.ir.dtypes import representable
from qcompiler.ir.ops.shapes import broadcast, dense, fail, int_list, norm_axis
from qcompiler.ir.types import DenseType, Dim, Type, is_dynamic


def dims_attr(op: Op, name: str, raw: list[AttrValue], keep: bool = False) -> list[Dim]:
    """``raw``, the list attribute ``name`` of ``op``, as dims: ints >= 0 (or ``-1`` when ``keep``: keep
    the operand's dim), or ``"?name"`` strings for dynamic sizes."""
    out: list[Dim] = []
    for d in raw:
        if isinstance(d, bool) or not isinstance(d, int | str) or (isinstance(d, str) and not is_dynamic(d)):
            raise fail(op, name, "dims must be ints or '?name' strings", "int or '?name'", d)
        if isinstance(d, int) and d < (-1 if keep else 0):
            raise fail(op, name, "a dim is a size >= 0", ">= -1 (-1 keeps a dim)" if keep else ">= 0", d)
        out.append(d)
    return out


class Full(Op, name="full"):
    """A tensor filled with one value (scalars in exported graphs become these).

    ``%eps = full() {value = 1e-06, shape = []} : tensor<f32[]>``
    """

    value = attr(float)
    shape = attr(list)
    result_kinds: ClassVar[tuple[TypeKind, ...]] = ("dense",)

    def verify_(self, module: Module) -> None:
        t = dense(self.result)
        if list(t.shape) != dims_attr(self, "shape", self.shape):
            raise fail(self, "shape", "result shape differs from the shape attribute", self.shape, t.short())
        if not representable(self.value, t.dtype):
            found = self.attrs["value"]  # as written: an int value prints without a '.0'
            raise fail(self, "value", f"the value is not a {t.dtype.name}", f"a value {t.dtype.name} holds", found)


class Arange(Op, name="arange"):
    """``[start, start+step, ...)`` up to ``end`` (an int or a dynamic dim such as ``"?seq"``).

    ``%pos = arange() {start = 0, end = "?seq", step = 1} : tensor<i64[?seq]>``
    """

    start = attr(int)
    end = dim_attr()
    step = attr(int)
    result_kinds: ClassVar[tuple[TypeKind, ...]] = ("dense",)

    def verify_(self, module: Module) -> None:
        t = dense(self.result)
        if t.rank != 1:
            raise fail(self, "result type", "arange gives a rank-1 tensor", "rank 1", t.short())
        end, start, step = self.end, self.start, self.step
        if step < 1:
            raise fail(self, "step", "step must be positive", ">= 1", step)
        if isinstance(end, int):
            n = len(range(start, end, step))
            if t.shape[0] != n:
                raise fail(self, "result type", "length does not follow from start/end/step", f"[{n}]", t.short())
        elif (start, step) != (0, 1) or t.shape[0] != end:
            # a dynamic end: only 0..end-1 has a length the type can name (the end's own symbol)
            want = f"start = 0, step = 1, result [{end}]"
            found = f"start = {start}, step = {step}, result {t.short()}"
            raise fail(self, "result type", "a dynamic end needs start 0 and step 1", want, found)


class Reduce(Op):
    """Reduction over ``axes`` (negative allowed), keeping reduced dims as 1 when ``keepdim``.

    ``%ms = mean(%sq) {axes = [-1], keepdim = true} : tensor<f32[1,?seq,1]>``
    """

    x = operand("dense")
    axes = attr(list)
    keepdim = attr(bool)

    def infer(self) -> list[Type]:
        x = dense(self.x)
        listed = [norm_axis(self, a, x.rank, "axes") for a in int_list(self, "axes", self.axes)]
        axes = set(listed)
        if len(axes) != len(listed):
            raise fail(self, "axes", "an axis is listed twice", "distinct axes", self.axes)
        keep = self.keepdim
        shape = [1 if i in axes else d for i, d in enumerate(x.shape) if keep or i not in axes]
        return [DenseType(x.dtype, tuple(shape))]


class Mean(Reduce, name="mean"):
    """Arithmetic mean over ``axes`` (see ``Reduce``)."""


class Sum(Reduce, name="sum"):
    """Sum over ``axes`` (see ``Reduce``)."""


class Expand(Op, name="expand"):
    """Broadcast to ``shape`` (``-1`` keeps a dim); like ``torch.Tensor.expand``.

    ``%kv = expand(%k1) {shape = [1, 2, 2, "?seq", 16]} : tensor<f32[1,2,2,?seq,16]>``
    """

    x = operand("dense")
    shape = attr(list)

    def infer(self) -> list[Type]:
        x = dense(self.x)
        want = dims_attr(self, "shape", self.shape, keep=True)
        if len(want) < x.rank:
            raise fail(self, "shape", "cannot expand to fewer dims", f">= {x.rank} dims", len(want))
        lead = len(want) - x.rank
        if -1 in want[:lead]:
            raise fail(self, "shape", "-1 keeps a dim of x, so a new leading dim needs a size", "a size >= 0", -1)
        shape = [x.shape[i - lead] if d == -1 else d for i, d in enumerate(want)]
        broadcast(self, x.shape, tuple(shape))
        return [DenseType(x.dtype, tuple(shape))]


class Gather(Op, name="gather"):
    """``out[i][j] = x[i][index[i][j]]`` along ``axis`` (``torch.gather``); result has the index's shape.

    ``%tt = gather(%types, %pos) {axis = 1} : tensor<i64[1,?seq]>``
    """

    x = operand("dense")
    index = operand("int")
    axis = attr(int)

    def infer(self) -> list[Type]:
        x, idx = dense(self.x), dense(self.index)
        if idx.rank != x.rank:
            raise fail(self, "index", "index must have the rank of x", f"rank {x.rank}", idx.short())
        norm_axis(self, self.axis, x.rank)
        return [DenseType(x.dtype, idx.shape)]


class Clamp(Op, name="clamp"):
    """Clamp to ``[min, max]``; either bound may be absent.

    ``%d = clamp(%n) {min = 1e-09} : tensor<f32[?batch,1]>``
    """

    x = operand("dense")
    min = optional_attr(float)
    max = optional_attr(float)

    def infer(self) -> list[Type]:
        return [self.x.type]


__all__ = ["Arange", "Clamp", "Expand", "Full", "Gather", "Mean", "Sum"]


class TopkMask(Op, name="topk_mask"):
    """``x`` where it is among the ``k`` largest along the last axis, else 0 (a MoE router's top-k
    weights scattered to a dense ``[tokens, experts]`` matrix; ties resolve as ``torch.topk``).

    ``%w = topk_mask(%p) {k = 2} : tensor<f32[1,?seq,8]>``
    """

    x = operand("float")
    k = attr(int)

    def infer(self) -> list[Type]:
        x = dense(self.x)
        width = x.shape[-1] if x.rank else 0
        if not isinstance(width, int) or not 1 <= self.k <= width:
            raise fail(self, "k", "k picks among the static last dim", f"1..{width}", self.k)
        return [self.x.type]

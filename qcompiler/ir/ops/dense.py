"""Dense (float / integer) ops: what real transformer graphs need around the quantized ones.

Each op below shows its textual form. All use the one generic syntax
``%r = name(%a, %b) {attrs} : result-types``.
"""

from __future__ import annotations

from typing import ClassVar

from qcompiler.ir.attrs import SymbolRef
from qcompiler.ir.core import (
    Module,
    Op,
    TypeKind,
    attr,
    dim_attr,
    operand,
    optional_operand,
    variadic_operand,
)
from qcompiler.ir.dtypes import DType
from qcompiler.ir.ops.shapes import (
    broadcast,
    dense,
    element_count,
    fail,
    int_list,
    norm_axis,
    same_dtype,
    shapes_match,
    show_count,
)
from qcompiler.ir.types import DenseType, Dim, Type, format_shape, is_dynamic


class Const(Op, name="const"):
    """A dense tensor from the tensor table.

    ``%b = const() {ref = @fc1.bias} : tensor<f32[64]>``
    """

    ref = attr(SymbolRef)
    result_kinds: ClassVar[tuple[TypeKind, ...]] = ("dense",)

    def verify_(self, module: Module) -> None:
        ref = self.ref
        decl = module.tensors.get(ref.name)
        if decl is None:
            raise fail(self, "ref", "unknown tensor", "a tensor-table entry", ref)
        t = dense(self.result)
        if t.dtype != decl.blob.dtype or t.shape != decl.blob.shape:
            raise fail(self, "result type", "does not match the tensor table", decl.type_str(), t.short())


class Linear(Op, name="linear"):
    """``y = x @ w.T + bias`` with ``w`` as ``[N, K]`` (out x in).

    ``%y = linear(%x, %w, %b) : tensor<f32[?batch,64]>``
    """

    x = operand("float")
    w = operand("float")
    bias = optional_operand("float")

    def infer(self) -> list[Type]:
        x, w = dense(self.x), dense(self.w)
        return [linear_result(self, x, w.shape, x.dtype)]

    def verify_(self, module: Module) -> None:
        same_dtype(self, self.operands)
        check_bias(self, dense(self.w).shape[0])


def linear_result(op: Op, x: DenseType, w_shape: tuple[Dim, ...], out_dtype: DType) -> DenseType:
    """Shared by ``linear`` and ``q.linear``: x ``[..., K]`` and w ``[N, K]`` give ``[..., N]``."""
    if len(w_shape) != 2:
        raise fail(op, "w", "weight must be rank 2 [N, K]", "rank 2", format_shape(w_shape))
    if x.rank < 1 or not shapes_match(x.shape[-1:], w_shape[1:]):
        raise fail(op, "x", "last dim must equal the weight's K", f"K={w_shape[1]}", format_shape(x.shape))
    return DenseType(out_dtype, (*x.shape[:-1], w_shape[0]))


def check_bias(op: Op, n: Dim) -> None:
    bias = op.operand("bias")
    if bias is None:
        return
    if not shapes_match(dense(bias).shape, (n,)):
        raise fail(op, "bias", "bias must be [N]", f"[{n}]", format_shape(dense(bias).shape))


class Matmul(Op, name="matmul"):
    """Batched matrix product with broadcast batch dims: ``[..., M, K] x [..., K, N] -> [..., M, N]``.

    ``%s = matmul(%q, %kt) : tensor<f32[1,4,?seq,?seq]>``
    """

    a = operand("float")
    b = operand("float")

    def infer(self) -> list[Type]:
        a, b = dense(self.a), dense(self.b)
        if a.rank < 2 or b.rank < 2:
            raise fail(self, "operands", "matmul needs rank >= 2", "rank >= 2", f"{a.rank} and {b.rank}")
        if not shapes_match(a.shape[-1:], b.shape[-2:-1]):
            raise fail(self, "b", "contraction dims differ", a.shape[-1], b.shape[-2])
        batch = broadcast(self, a.shape[:-2], b.shape[:-2])
        return [DenseType(a.dtype, (*batch, a.shape[-2], b.shape[-1]))]

    def verify_(self, module: Module) -> None:
        same_dtype(self, self.operands)


class Embedding(Op, name="embedding"):
    """Row lookup: ``w`` ``[V, D]``, integer ``ids`` -> ``ids.shape + [D]``.

    ``%h = embedding(%w, %ids) : tensor<f32[1,?seq,64]>``
    """

    w = operand("float")
    ids = operand("int")

    def infer(self) -> list[Type]:
        w, ids = dense(self.w), dense(self.ids)
        if w.rank != 2:
            raise fail(self, "w", "embedding table must be rank 2 [V, D]", "rank 2", w.rank)
        return [DenseType(w.dtype, (*ids.shape, w.shape[1]))]


class Binary(Op):
    """Elementwise binary op with numpy broadcasting; operands share a dtype.

    ``%z = add(%x, %y) : tensor<f32[?batch,64]>``
    """

    lhs = operand("dense")
    rhs = operand("dense")

    def infer(self) -> list[Type]:
        a, b = dense(self.lhs), dense(self.rhs)
        return [DenseType(a.dtype, broadcast(self, a.shape, b.shape))]

    def verify_(self, module: Module) -> None:
        same_dtype(self, self.operands)


class Unary(Op):
    """Elementwise unary op; result type equals the operand type.

    ``%y = silu(%x) : tensor<f32[?batch,64]>``
    """

    x = operand("float")

    def infer(self) -> list[Type]:
        return [self.x.type]


BINARY_OPS = ("add", "sub", "mul", "div", "pow", "maximum", "minimum")
UNARY_OPS = ("neg", "exp", "log", "sqrt", "rsqrt", "abs", "relu", "silu", "sigmoid", "tanh", "erf", "cos", "sin")

for _name in BINARY_OPS:
    type(_name.capitalize(), (Binary,), {"__doc__": f"Elementwise ``{_name}`` (see ``Binary``)."}, name=_name)
for _name in UNARY_OPS:
    type(_name.capitalize(), (Unary,), {"__doc__": f"Elementwise ``{_name}`` (see ``Unary``)."}, name=_name)


class Gelu(Unary, name="gelu"):
    """GELU, exact (``erf``) or ``tanh`` approximation.

    ``%y = gelu(%x) {approximate = "none"} : tensor<f32[?batch,64]>``
    """

    approximate = attr(str, choices=("none", "tanh"))


class Norm(Op):
    """Normalization over the last dim; its optional parameters (after ``x``) are ``[D]``."""

    x = operand("float")
    weight = optional_operand("float")
    eps = attr(float)

    def infer(self) -> list[Type]:
        return [self.x.type]

    def verify_(self, module: Module) -> None:
        x = dense(self.x)
        for spec in self.operand_specs[1:]:
            v = self.operand(spec.name)
            if v is not None and not shapes_match(dense(v).shape, x.shape[-1:]):
                want, found = format_shape(x.shape[-1:]), format_shape(dense(v).shape)
                raise fail(self, spec.name, "norm parameters must be [D], D the last dim of x", want, found)


class LayerNorm(Norm, name="layer_norm"):
    """Layer norm over the last dim with optional affine weight and bias ``[D]``.

    ``%y = layer_norm(%x, %g, %b) {eps = 1e-12} : tensor<f32[1,?seq,64]>``
    """

    bias = optional_operand("float")


class RmsNorm(Norm, name="rms_norm"):
    """RMS norm over the last dim with an optional weight ``[D]``.

    ``%y = rms_norm(%x, %g) {eps = 1e-06} : tensor<f32[1,?seq,64]>``
    """


class Softmax(Op, name="softmax"):
    """Softmax along ``axis``.

    ``%p = softmax(%s) {axis = -1} : tensor<f32[1,4,?seq,?seq]>``
    """

    x = operand("float")
    axis = attr(int)

    def infer(self) -> list[Type]:
        norm_axis(self, self.axis, dense(self.x).rank)
        return [self.x.type]


class Cast(Op, name="cast"):
    """Element type conversion.

    ``%h = cast(%x) {dtype = f16} : tensor<f16[?batch,64]>``
    """

    x = operand("dense")
    dtype = attr(DType)

    def infer(self) -> list[Type]:
        return [DenseType(self.dtype, dense(self.x).shape)]


class Reshape(Op, name="reshape"):
    """Reshape to ``shape`` (ints >= 0, or ``"?name"`` strings for dynamic dims; no ``-1``: the
    runtime binds every ``?name``); element counts must agree.

    ``%y = reshape(%x) {shape = [1, "?seq", 4, 16]} : tensor<f32[1,?seq,4,16]>``
    """

    x = operand("dense")
    shape = attr(list)

    def infer(self) -> list[Type]:
        shape: list[Dim] = []
        for d in self.shape:
            if isinstance(d, bool) or not isinstance(d, int | str) or (isinstance(d, str) and not is_dynamic(d)):
                raise fail(self, "shape", "dims must be ints or '?name' strings", "int or '?name'", d)
            if isinstance(d, str) and not d.startswith("?"):
                raise fail(self, "shape", "dynamic dims start with '?'", "'?name'", d)
            if isinstance(d, int) and d < 0:
                raise fail(self, "shape", "a dim is a size >= 0 (a dynamic one is spelled '?name')", ">= 0", d)
            shape.append(d)
        x = dense(self.x)
        out = DenseType(x.dtype, tuple(shape))
        n_in, n_out = x.numel(), out.numel()
        if n_in is not None and n_out is not None and n_in != n_out:
            raise fail(self, "shape", "element count changes", n_in, n_out)
        count_in, count_out = element_count(x.shape), element_count(out.shape)
        if (n_in is None or n_out is None) and count_in != count_out:
            # dynamic sizes: the count follows only with the same '?name' dims and the same static product
            raise fail(self, "shape", "element count does not follow", show_count(count_in), show_count(count_out))
        return [out]


class Transpose(Op, name="transpose"):
    """Permute dims: result dim ``i`` is operand dim ``perm[i]``.

    ``%t = transpose(%x) {perm = [0, 2, 1, 3]} : tensor<f32[1,4,?seq,16]>``
    """

    x = operand("dense")
    perm = attr(list)

    def infer(self) -> list[Type]:
        x = dense(self.x)
        perm = int_list(self, "perm", self.perm)
        if sorted(perm) != list(range(x.rank)):
            raise fail(self, "perm", "not a permutation of the dims", f"a permutation of 0..{x.rank - 1}", perm)
        return [DenseType(x.dtype, tuple(x.shape[p] for p in perm))]


class Slice(Op, name="slice"):
    """``x[start:end:step]`` along ``axis`` (end is clamped to the dim, like Python; it may be a
    dynamic size such as ``"?seq"``).

    ``%h = slice(%x) {axis = -1, start = 0, end = 32, step = 1} : tensor<f32[1,?seq,32]>``
    """

    x = operand("dense")
    axis = attr(int)
    start = attr(int)
    end = dim_attr()
    step = attr(int)

    def infer(self) -> list[Type]:
        x = dense(self.x)
        axis = norm_axis(self, self.axis, x.rank)
        step = self.step
        if step < 1:
            raise fail(self, "step", "step must be positive", ">= 1", step)
        dim, end = x.shape[axis], self.end
        if is_dynamic(dim) or not isinstance(end, int):
            size: Dim = "?"
        else:
            size = len(range(*slice(self.start, end, step).indices(int(dim))))
        return [DenseType(x.dtype, (*x.shape[:axis], size, *x.shape[axis + 1 :]))]


class Concat(Op, name="concat"):
    """Concatenate along ``axis``; other dims must agree.

    ``%kv = concat(%past, %new) {axis = 2} : tensor<f32[1,2,?total,16]>``
    """

    xs = variadic_operand("dense")
    axis = attr(int)

    def infer(self) -> list[Type]:
        if not self.xs:
            raise fail(self, "operands", "concat needs at least one operand", ">= 1", 0)
        first = dense(self.xs[0])
        axis = norm_axis(self, self.axis, first.rank)
        total: Dim = 0
        for v in self.xs:
            t = dense(v)
            rest = (*t.shape[:axis], *t.shape[axis + 1 :])
            if t.rank != first.rank or not shapes_match(rest, (*first.shape[:axis], *first.shape[axis + 1 :])):
                raise fail(self, "operands", "non-concatenated dims differ", first.short(), t.short())
            d = t.shape[axis]
            total = "?" if is_dynamic(d) or is_dynamic(total) else int(total) + int(d)
        return [DenseType(first.dtype, (*first.shape[:axis], total, *first.shape[axis + 1 :]))]

    def verify_(self, module: Module) -> None:
        same_dtype(self, self.operands)


class Return(Op, name="return"):
    """Ends a graph and names its outputs.

    ``return(%logits)``
    """

    values = variadic_operand("any")
    result_kinds = ()

    def infer(self) -> list[Type]:
        return []

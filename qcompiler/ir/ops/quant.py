"""Quantized ops. The quantized value's type is its full descriptor (see ``qcompiler.ir.types``).

``q.weight`` binds a descriptor to tensor-table entries; ``q.dequantize``/``q.quantize`` cross
between dense and quantized values; ``q.linear``/``q.embedding`` consume quantized weights directly.

A weight's descriptor is static (every dim of the tensor and of each slot, nested ones too) and
decodes to the dtype its consumers compute in: ``q.linear``'s activation dtype, ``q.embedding``'s
and ``q.dequantize``'s result dtype::

    %w = q.weight() {codes = @w.codes, scale = @w.scale} : !q.affine<i4[-8:7] -> f64[64,64], ...>
    %y = q.linear(%x, %w) : tensor<f32[?b,64]>
    // error: %y = q.linear: w: ... (expected f32, found f64)
"""

from __future__ import annotations

from typing import ClassVar

from qcompiler.ir.attrs import AttrValue, SymbolRef, attr_kind
from qcompiler.ir.core import Module, Op, TypeKind, attr, operand, optional_attr, optional_operand
from qcompiler.ir.layouts import Logical, find_layout
from qcompiler.ir.ops.dense import check_bias, linear_result
from qcompiler.ir.ops.shapes import dense, fail, quant, shapes_match
from qcompiler.ir.types import DenseType, QuantType, Type, format_shape


def static_dims(op: Op, t: DenseType, field: str, what: str) -> tuple[int, ...]:
    """``t``'s shape as ints; a dynamic dim is refused (``what`` says whose shape it is)."""
    if not t.is_static:
        raise fail(op, field, f"{what} must have a static shape", "static dims", t.short())
    return tuple(d for d in t.shape if isinstance(d, int))


def check_binding(op: Op, module: Module, t: QuantType, binding: dict[str, AttrValue], path: str) -> None:
    """Every slot of ``t`` (``codes``, qparams, exceptions, transforms, ``perm``) is bound to a tensor
    whose dtype and shape are exactly what the descriptor and its layout say."""
    static_dims(op, t.expressed, f"{path}type" if path else "result type", "a weight")
    slots = t.slots()
    expected = ["codes", *slots]
    for key in binding:
        if key not in expected:
            raise fail(op, f"{path}{key}", "binds a slot the descriptor does not have", " | ".join(expected), key)
    for key in expected:
        if key not in binding:
            raise fail(op, f"{path}{key}", "descriptor slot is not bound to a tensor", f"{key} = @tensor", "nothing")
    layout = find_layout(t.pack.family, t.pack.version)
    assert layout is not None  # checked with the descriptor
    if layout is not Logical and t.rank != 2:
        raise fail(
            op,
            f"{path}pack",
            f"layout {t.pack.family} v{t.pack.version} stores a rank-2 [N, K] weight",
            "rank 2",
            t.expressed.short(),
        )
    want_codes = layout.physical(t)
    check_ref(op, module, binding["codes"], want_codes[0].name, want_codes[1], f"{path}codes")
    for name, slot in slots.items():
        value = binding[name]
        if isinstance(slot, QuantType):
            if not isinstance(value, dict):
                raise fail(
                    op,
                    f"{path}{name}",
                    "a quantized qparam is bound with a nested {codes = ..., ...}",
                    "dict",
                    attr_kind(value),
                )
            check_binding(op, module, slot, value, f"{path}{name}.")
            continue
        shape = static_dims(op, slot, f"{path}{name}", f"slot '{name}' of a weight")
        check_ref(op, module, value, slot.dtype.name, shape, f"{path}{name}")


def check_ref(op: Op, module: Module, value: AttrValue, dtype: str, shape: tuple[int, ...], field: str) -> None:
    if not isinstance(value, SymbolRef):
        raise fail(op, field, "must reference a tensor", "@name", attr_kind(value))
    decl = module.tensors.get(value.name)
    if decl is None:
        raise fail(op, field, "unknown tensor", "a tensor-table entry", value)
    found = decl.type_str()
    want = f"{dtype}{format_shape(shape)}"
    if found != want:
        raise fail(op, field, f"tensor {value} does not match the descriptor", want, found)


class Weight(Op, name="q.weight"):
    """A quantized weight: its descriptor (the result type) bound to tensor-table entries.

    ``%w = q.weight() {codes = @fc1.codes, scale = @fc1.scale} : !q.affine<i4[-8:7] -> f32[64,32], ...>``

    Nested (quantized) qparams bind with a nested dict: ``scale = {codes = @s.codes, scale = @s.d}``.
    """

    codes = attr(SymbolRef)
    """The tensor-table entry of the codes; the other slots' bindings are open attributes."""
    open_attrs = True
    result_kinds: ClassVar[tuple[TypeKind, ...]] = ("quant",)

    @property
    def weight_name(self) -> str:
        """The weight's name: ``layers.0.fc1.weight`` for codes ``@layers.0.fc1.weight.codes``."""
        return self.codes.name.removesuffix(".codes")

    def verify_(self, module: Module) -> None:
        check_binding(self, module, quant(self.result), self.attrs, "")


class Dequantize(Op, name="q.dequantize"):
    """Decode a quantized value to its expressed dense type.

    ``%wf = q.dequantize(%w) : tensor<f32[64,32]>``
    """

    x = operand("quant")

    def infer(self) -> list[Type]:
        return [quant(self.x).expressed]


class Quantize(Op, name="q.quantize"):
    """Quantize a dense value to the result descriptor (activation Q/DQ). Static qparams are bound
    with ``bind = {scale = @s, ...}``; without ``bind`` they are computed at run time.

    ``%xq = q.quantize(%x) : !q.affine<u8[0:255] -> f32[?batch,32], ...>``
    """

    x = operand("float")
    bind = optional_attr(dict)
    result_kinds: ClassVar[tuple[TypeKind, ...]] = ("quant",)

    def verify_(self, module: Module) -> None:
        x, t = dense(self.x), quant(self.result)
        if x.dtype != t.expressed.dtype or not shapes_match(x.shape, t.shape):
            raise fail(self, "x", "operand must have the descriptor's expressed type", t.expressed.short(), x.short())
        bind = self.bind
        if bind is not None:
            slots = {k: v for k, v in t.slots().items() if isinstance(v, DenseType)}
            for name, value in bind.items():
                slot = slots.get(name)
                if slot is None:
                    raise fail(
                        self, f"bind.{name}", "binds a slot the descriptor does not have", " | ".join(slots), name
                    )
                shape = static_dims(self, slot, f"bind.{name}", f"bound qparam '{name}'")
                check_ref(self, module, value, slot.dtype.name, shape, f"bind.{name}")


def check_req(op: Op, t: QuantType, use: str) -> None:
    if t.req not in ("any", use):
        raise fail(op, "w", f"descriptor is not meant for {use}", f"req={use} or req=any", f"req={t.req}")


class QLinear(Op, name="q.linear"):
    """``y = x @ decode(w).T + bias`` with a quantized ``[N, K]`` weight; output has x's dtype.

    ``%y = q.linear(%x, %w, %b) : tensor<f32[?batch,64]>``
    """

    x = operand("float")
    w = operand("quant")
    bias = optional_operand("float")

    def infer(self) -> list[Type]:
        x, w = dense(self.x), quant(self.w)
        return [linear_result(self, x, w.shape, x.dtype)]

    def verify_(self, module: Module) -> None:
        x, w = dense(self.x), quant(self.w)
        check_req(self, w, "linear")
        check_bias(self, w.shape[0])
        if w.expressed.dtype != x.dtype:
            raise fail(
                self,
                "w",
                f"weight %{self.w.name} decodes to {w.expressed.dtype}, but q.linear computes in its activation dtype",
                x.dtype,
                w.expressed.dtype,
            )
        bias = self.bias
        if bias is not None and dense(bias).dtype != x.dtype:
            raise fail(self, "bias", "bias dtype differs from the activation dtype", x.dtype, dense(bias).dtype)


class QEmbedding(Op, name="q.embedding"):
    """Row lookup in a quantized ``[V, D]`` table; rows decode to the expressed dtype.

    ``%h = q.embedding(%w, %ids) : tensor<f32[1,?seq,64]>``
    """

    w = operand("quant")
    ids = operand("int")

    def infer(self) -> list[Type]:
        w, ids = quant(self.w), dense(self.ids)
        if w.rank != 2:
            raise fail(self, "w", "embedding table must be rank 2 [V, D]", "rank 2", w.rank)
        return [DenseType(w.expressed.dtype, (*ids.shape, w.shape[1]))]

    def verify_(self, module: Module) -> None:
        check_req(self, quant(self.w), "embedding")


class SourceWeight(Op, name="q.source_weight"):
    """A weight's quantization state exactly as the source stated it, before ``freeze-semantics``.

    Codes and qparams are tensor refs; ``block`` is the source's block size per dim (``[1, 32]``:
    groups of 32 along axis 1; a dim equal to the whole axis means one group); ``qmin``/``qmax`` the
    code range; ``g_idx`` (optional, GPTQ act-order) the group of each column along K; ``family``
    (optional, default affine) ``f8e4m3`` for float8 bit patterns (``x = e4m3fn(code) * scale``);
    ``effective`` the float weight the source's own dequantize produced (the value
    ``freeze-semantics`` must reproduce exactly), or, for a source streamed without ever holding the
    model, ``decode_op``: the source's dequantize op, which ``freeze-semantics`` evaluates on the
    codes when it proves them (one weight at a time). The result is that dense weight.

    ``%w = q.source_weight() {source = "torchao.dequantize_affine", codes = @w.codes, scale = @w.scale,
    zero = @w.zero, block = [1, 32], qmin = -8, qmax = 7, effective = @w.effective} : tensor<f32[64,32]>``
    """

    source = attr(str)
    codes = attr(SymbolRef)
    scale = attr(SymbolRef)
    zero = optional_attr(SymbolRef)
    g_idx = optional_attr(SymbolRef)
    block = attr(list)
    qmin = attr(int)
    qmax = attr(int)
    effective = optional_attr(SymbolRef)
    decode_op = optional_attr(str, choices=("qcompiler::dequantize_affine",))
    family = optional_attr(str, choices=("f8e4m3",))

    def verify_(self, module: Module) -> None:
        t = dense(self.result)
        shape = static_dims(self, t, "result type", "a source weight")
        if self.family is not None and (self.decode_op is not None or self.g_idx is not None or self.zero is not None):
            raise fail(self, "family", "a float8 weight is proven against its effective weight, without zero or g_idx")
        effective = self.effective
        if (effective is None) == (self.decode_op is None):
            raise fail(self, "effective", "exactly one of effective and decode_op", "one", "both or neither")
        if effective is not None:
            check_ref(self, module, effective, t.dtype.name, shape, "effective")
        codes = self.codes
        decl = module.tensors.get(codes.name)
        if decl is None:
            raise fail(self, "codes", "unknown tensor", "a tensor-table entry", codes)
        if decl.blob.shape != shape or not decl.blob.dtype.is_integer:
            raise fail(
                self, "codes", "codes must be integers of the weight's shape", f"int{list(shape)}", decl.type_str()
            )
        for name, ref in (("scale", self.scale), ("zero", self.zero), ("g_idx", self.g_idx)):
            if ref is not None and ref.name not in module.tensors:
                raise fail(self, name, "unknown tensor", "a tensor-table entry", ref)
        block = self.block
        if len(block) != len(shape) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block
        ):
            raise fail(self, "block", "one positive block size per dim", f"{len(shape)} ints >= 1", block)
        qmin, qmax = self.qmin, self.qmax
        if qmin > qmax:
            raise fail(self, "qmin", "empty code range", "qmin <= qmax", f"{qmin} > {qmax}")


def weight_name(op: Op) -> str:
    """``Weight.weight_name`` of ``op``, a ``q.weight`` (anything else is a ``TypeError``)."""
    if not isinstance(op, Weight):
        raise TypeError(f"{op.describe()} is not a q.weight")
    return op.weight_name

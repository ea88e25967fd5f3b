"""Typed operand accessors: ``x = operand("float")`` in an op's class body gives ``op.x`` (a
``Value``), ``optional_operand`` a ``Value | None``, ``variadic_operand`` a ``list[Value]``, and the
class's ``operand_specs`` in declaration order; a class may still set ``operand_specs`` by hand."""

from __future__ import annotations

import pytest

from qcompiler.ir.core import Op, OperandDecl, OperandSpec, Value, operand, optional_operand, variadic_operand
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.ops.attention import Sdpa
from qcompiler.ir.ops.dense import Concat, LayerNorm, RmsNorm
from qcompiler.ir.ops.quant import QLinear
from qcompiler.ir.types import DenseType

F32 = DenseType(DTYPES["f32"], (4, 8))


def values(*names: str) -> list[Value]:
    return [Value(n, F32) for n in names]


def test_specs_are_built_in_declaration_order() -> None:
    assert QLinear.operand_specs == (
        OperandSpec("x", "float"),
        OperandSpec("w", "quant"),
        OperandSpec("bias", "float", optional=True),
    )
    assert Concat.operand_specs == (OperandSpec("xs", "dense", variadic=True),)
    assert [s.name for s in Sdpa.operand_specs] == ["q", "k", "v", "mask"]
    assert isinstance(QLinear.w, OperandDecl)  # on the class: the declaration


def test_accessors_return_the_declared_operands() -> None:
    x, w, b = values("x", "w", "b")
    op = QLinear([x, w, b], [F32])
    assert (op.x, op.w, op.bias) == (x, w, b)
    assert op.operand("bias") is b
    assert QLinear([x, w], [F32]).bias is None  # optional and absent


def test_variadic_is_a_list() -> None:
    xs = values("a", "b", "c")
    assert Concat(xs, [F32], {"axis": 0}).xs == xs
    assert Concat([], [F32], {"axis": 0}).xs == []


def test_subclasses_extend_the_inherited_operands() -> None:
    assert [s.name for s in LayerNorm.operand_specs] == ["x", "weight", "bias"]
    assert [s.name for s in RmsNorm.operand_specs] == ["x", "weight"]
    x, g = values("x", "g")
    norm = RmsNorm([x, g], [F32], {"eps": 1e-6})
    assert (norm.x, norm.weight) == (x, g)
    assert not hasattr(norm, "bias")  # declared on LayerNorm only


def test_redeclared_operand_keeps_its_place() -> None:
    class Base(Op):
        a = operand("float")
        b = operand("float")

    class Narrow(Base):
        a = operand("int")
        c = optional_operand("int")

    assert Narrow.operand_specs == (OperandSpec("a", "int"), OperandSpec("b", "float"), OperandSpec("c", "int", True))


def test_specs_set_by_hand_still_work() -> None:
    class Hand(Op):
        operand_specs = (OperandSpec("lhs"), OperandSpec("rest", variadic=True))

    a, b, c = values("a", "b", "c")
    op = Hand([a, b, c], [F32])
    assert op.operand("lhs") is a
    assert Hand.operand_specs[1].variadic

    class NoBias(QLinear):  # inherits the accessors; they follow the specs set here
        operand_specs = (OperandSpec("w", "quant"), OperandSpec("x", "float"))

    narrow = NoBias([a, b], [F32])
    assert (narrow.w, narrow.x) == (a, b)
    with pytest.raises(AttributeError, match="no operand 'bias'"):
        _ = narrow.bias


def test_declaration_errors() -> None:
    with pytest.raises(TypeError, match="not both"):

        class Both(Op):  # pyright: ignore[reportUnusedClass]
            operand_specs = (OperandSpec("x"),)
            y = operand()

    with pytest.raises(TypeError, match="only the last operand may be variadic"):

        class Middle(Op):  # pyright: ignore[reportUnusedClass]
            xs = variadic_operand()
            y = operand()

    with pytest.raises(TypeError, match=r"would hide Op\.result"):

        class Hiding(Op):  # pyright: ignore[reportUnusedClass]
            result = operand()  # pyright: ignore[reportAssignmentType, reportIncompatibleMethodOverride]

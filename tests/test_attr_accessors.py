"""Typed attribute accessors: ``axis = attr(int)`` in an op's class body gives ``op.axis`` (an
``int``), ``optional_attr(float)`` a ``float | None``, ``dim_attr()`` an ``int | str``, and the class's
``attr_specs`` in declaration order; setting one writes ``op.attrs``; a class may still set
``attr_specs`` by hand, and the verifier reads ``attr_specs`` as before."""

from __future__ import annotations

import pytest

from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.core import AttrDecl, AttrSpec, Op, attr, dim_attr, operand, optional_attr
from qcompiler.ir.decls import ATTR_KINDS
from qcompiler.ir.dtypes import DTYPES, DType
from qcompiler.ir.ops.attention import Rotary, Sdpa
from qcompiler.ir.ops.dense import LayerNorm, Slice
from qcompiler.ir.ops.tensor import Clamp
from qcompiler.ir.types import DenseType

F32 = DenseType(DTYPES["f32"], (4, 8))


class Every(Op):
    """One attribute of each kind (not registered)."""

    i = attr(int)
    f = attr(float)
    s = attr(str, choices=("a", "b"))
    b = attr(bool)
    sym = attr(SymbolRef)
    items = attr(list)
    table = attr(dict)
    dt = attr(DType)
    size = dim_attr()
    maybe = optional_attr(float)


def every(**attrs: AttrValue) -> Every:
    return Every([], [F32], attrs)


def test_each_kind_reads_its_value_and_writes_attrs() -> None:
    f16 = DTYPES["f16"]
    op = every(
        i=3, f=0.5, s="a", b=True, sym=SymbolRef("w"), items=[1, "?n"], table={"k": 1}, dt=f16, size="?seq", maybe=2.5
    )
    assert (op.i, op.f, op.s, op.b, op.sym) == (3, 0.5, "a", True, SymbolRef("w"))
    assert (op.items, op.table, op.dt, op.size, op.maybe) == ([1, "?n"], {"k": 1}, f16, "?seq", 2.5)
    items: list[AttrValue] = [2]
    op.i, op.f, op.s, op.b, op.sym = 4, 1.5, "b", False, SymbolRef("v")
    op.items, op.table, op.dt, op.size, op.maybe = items, {}, DTYPES["f32"], 7, 0.25
    assert op.attrs == {
        "i": 4,
        "f": 1.5,
        "s": "b",
        "b": False,
        "sym": SymbolRef("v"),
        "items": [2],
        "table": {},
        "dt": DTYPES["f32"],
        "size": 7,
        "maybe": 0.25,
    }


def test_optional_absent_is_none_and_setting_none_removes_it() -> None:
    op = every(maybe=1.0)
    op.maybe = None
    assert op.maybe is None
    assert "maybe" not in op.attrs
    assert Clamp([], [F32], {"min": 0.0}).max is None
    assert Sdpa([], [F32], {"causal": True}).scale is None


def test_a_float_stored_as_int_reads_as_float() -> None:
    op = every(f=2, maybe=3)
    assert isinstance(op.f, float)
    assert isinstance(op.maybe, float)
    assert (op.f, op.maybe) == (2.0, 3.0)
    assert isinstance(op.attrs["f"], int)  # stored (and printed) as written


def test_missing_required_names_op_and_attribute() -> None:
    op = Slice([], [F32], {"axis": 0}, ["h"])
    with pytest.raises(AttributeError, match=r"%h = slice: missing attribute 'start' \(a required int\)"):
        _ = op.start


def test_wrong_kind_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="attribute 'i' is string, expected int"):
        _ = every(i="3").i
    with pytest.raises(TypeError, match="attribute 'i' is bool, expected int"):
        _ = every(i=True).i
    with pytest.raises(TypeError, match="attribute 'size' is string, expected dim"):
        _ = every(size="seq").size


def test_on_the_class_the_declaration() -> None:
    assert isinstance(Slice.axis, AttrDecl)
    assert Slice.end.spec == AttrSpec("end", "dim")
    assert set(ATTR_KINDS.values()) == {"int", "float", "string", "bool", "symbol", "list", "dict", "dtype"}


def test_specs_are_built_in_declaration_order() -> None:
    assert Every.attr_specs == (
        AttrSpec("i", "int"),
        AttrSpec("f", "float"),
        AttrSpec("s", "string", choices=("a", "b")),
        AttrSpec("b", "bool"),
        AttrSpec("sym", "symbol"),
        AttrSpec("items", "list"),
        AttrSpec("table", "dict"),
        AttrSpec("dt", "dtype"),
        AttrSpec("size", "dim"),
        AttrSpec("maybe", "float", required=False),
    )
    assert Slice.attr_specs == (
        AttrSpec("axis", "int"),
        AttrSpec("start", "int"),
        AttrSpec("end", "dim"),
        AttrSpec("step", "int"),
    )
    assert Sdpa.attr_specs == (
        AttrSpec("causal", "bool"),
        AttrSpec("scale", "float", required=False),
        AttrSpec("window", "int", required=False),
        AttrSpec("softcap", "float", required=False),
    )
    assert Rotary.attr_specs == (AttrSpec("style", "string", choices=("half", "interleaved")),)


def test_inherited_first_and_a_redeclared_name_keeps_its_place() -> None:
    assert LayerNorm.attr_specs == (AttrSpec("eps", "float"),)  # declared on Norm
    assert LayerNorm([], [F32], {"eps": 1e-5}).eps == 1e-5

    class Base(Op):
        a = attr(int)
        b = attr(int)

    class Child(Base):
        c = attr(str)
        a = attr(float)

    assert Child.attr_specs == (AttrSpec("a", "float"), AttrSpec("b", "int"), AttrSpec("c", "string"))
    assert Base.attr_specs == (AttrSpec("a", "int"), AttrSpec("b", "int"))


def test_attr_specs_set_by_hand_still_work() -> None:
    class Hand(Op):
        attr_specs = (AttrSpec("axis", "int"), AttrSpec("mode", "string", required=False, choices=("a", "b")))

    assert [s.name for s in Hand.attr_specs] == ["axis", "mode"]

    class Declared(Hand):
        extra = attr(bool)

    assert [s.name for s in Declared.attr_specs] == ["axis", "mode", "extra"]


def test_declaration_errors() -> None:
    with pytest.raises(TypeError, match="not both"):

        class Both(Op):  # pyright: ignore[reportUnusedClass]
            attr_specs = (AttrSpec("x", "int"),)
            y = attr(int)

    with pytest.raises(TypeError, match=r"attribute 'result' would hide Op\.result"):

        class Hiding(Op):  # pyright: ignore[reportUnusedClass]
            result = attr(int)  # pyright: ignore[reportAssignmentType, reportIncompatibleMethodOverride]

    with pytest.raises(TypeError, match=r"attribute 'attrs' would hide Op\.attrs"):

        class HidingField(Op):  # pyright: ignore[reportUnusedClass]
            attrs = attr(dict)  # pyright: ignore[reportAssignmentType, reportIncompatibleVariableOverride]

    class WithX(Op):
        x = operand()
        y = attr(int)

    with pytest.raises(TypeError, match="attribute 'x' has the name of an operand"):

        class AttrClash(WithX):  # pyright: ignore[reportUnusedClass]
            x = attr(int)  # pyright: ignore[reportAssignmentType, reportIncompatibleVariableOverride]

    with pytest.raises(TypeError, match="operand 'y' has the name of an attribute"):

        class OperandClash(WithX):  # pyright: ignore[reportUnusedClass]
            y = operand()  # pyright: ignore[reportAssignmentType, reportIncompatibleVariableOverride]

    with pytest.raises(TypeError, match="no attribute kind for complex"):
        attr(complex)

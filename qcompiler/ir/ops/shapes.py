"""Shape helpers shared by op definitions. Dynamic dims (``?name``) match anything."""

from __future__ import annotations

from qcompiler.errors import VerifyError
from qcompiler.ir.attrs import AttrValue
from qcompiler.ir.core import Op, Value
from qcompiler.ir.types import DenseType, Dim, QuantType, Type, format_shape, shapes_match


def types_match(declared: Type, inferred: Type) -> bool:
    """Declared result type agrees with the inferred one (dynamic dims match any size)."""
    if isinstance(declared, QuantType) or isinstance(inferred, QuantType):
        return declared == inferred
    return declared.dtype == inferred.dtype and shapes_match(declared.shape, inferred.shape)


def dense(v: Value) -> DenseType:
    """The operand's dense type (operand kinds are checked before ``infer`` runs)."""
    assert isinstance(v.type, DenseType)
    return v.type


def quant(v: Value) -> QuantType:
    assert isinstance(v.type, QuantType)
    return v.type


def fail(op: Op, field: str, message: str, expected: object = "", found: object = "") -> VerifyError:
    return VerifyError(message, where=op.describe(), field=field, expected=str(expected), found=str(found), loc=op.loc)


def broadcast(op: Op, a: tuple[Dim, ...], b: tuple[Dim, ...]) -> tuple[Dim, ...]:
    """Numpy broadcasting, provable from the types: dims pair up when one is 1 or both are the same
    (the same size, or the same ``?name``). A dynamic dim against another size could only broadcast
    if it happened to equal it at run time, which no exported graph relies on (the exporter would have
    specialised or unified the sizes), so that is a verify error like a static mismatch."""
    out: list[Dim] = []
    for i in range(max(len(a), len(b))):
        x = a[len(a) - 1 - i] if i < len(a) else 1
        y = b[len(b) - 1 - i] if i < len(b) else 1
        if x == 1:
            out.append(y)
        elif y == 1 or x == y:
            out.append(x)
        else:
            raise fail(op, "operands", f"shapes {format_shape(a)} and {format_shape(b)} do not broadcast")
    return tuple(reversed(out))


def same_dtype(op: Op, values: list[Value]) -> None:
    dtypes = {dense(v).dtype.name for v in values}
    if len(dtypes) > 1:
        raise fail(op, "operands", "operand dtypes differ", "one dtype", ", ".join(sorted(dtypes)))


def norm_axis(op: Op, axis: int, rank: int, field: str = "axis") -> int:
    if not -rank <= axis < rank:
        raise fail(op, field, "axis out of range", f"in [{-rank}, {rank - 1}]", axis)
    return axis % rank


def int_list(op: Op, field: str, values: list[AttrValue]) -> list[int]:
    """``values`` (the list attribute ``field`` of ``op``) as ints; another element fails verification."""
    out: list[int] = []
    for x in values:
        if not isinstance(x, int) or isinstance(x, bool):
            raise fail(op, field, "list must hold integers", "int", x)
        out.append(x)
    return out


__all__ = ["broadcast", "dense", "fail", "quant", "shapes_match", "types_match"]


def element_count(shape: tuple[Dim, ...]) -> tuple[int, tuple[str, ...]]:
    """A shape's element count as (product of its static dims, its dynamic dims sorted)."""
    static = 1
    for d in shape:
        if isinstance(d, int):
            static *= d
    return static, tuple(sorted(str(d) for d in shape if not isinstance(d, int)))


def show_count(count: tuple[int, tuple[str, ...]]) -> str:
    return "*".join([str(count[0]), *count[1]])

"""The verifier: module and tensor attributes, structure, SSA and types, per-op rules, descriptor
invariants, claimed pipeline invariants, and (on request) the data rules that need the bytes.

``verify_module(m)`` raises the first ``VerifyError`` it finds, naming the op or tensor, the field,
and what was expected and found. It runs after every pass unless switched off::

    %w = test.producer() : tensor<f32[4611686018427387904,4]>
    // error: %w = test.producer: result %w: element count overflows int64 (expected ...)
"""

from __future__ import annotations

import math

from qcompiler.errors import VerifyError
from qcompiler.ir.attrs import attr_kind, format_attr
from qcompiler.ir.core import Graph, Module, Op, TypeKind
from qcompiler.ir.decls import kind_matches
from qcompiler.ir.descriptor import DescriptorError, check_descriptor
from qcompiler.ir.invariants import check_invariants
from qcompiler.ir.module_attrs import INT64_MAX, check_module_attrs
from qcompiler.ir.ops.shapes import types_match
from qcompiler.ir.types import DenseType, QuantType, Type


def kind_ok(kind: TypeKind, t: Type) -> bool:
    if kind == "any":
        return True
    if kind == "quant":
        return isinstance(t, QuantType)
    if not isinstance(t, DenseType):
        return False
    if kind == "float":
        return t.dtype.is_float
    if kind == "int":
        return t.dtype.is_integer
    return True


def article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def kind_phrase(kind: TypeKind) -> str:
    """``an int tensor``, ``a quant tensor`` ... for messages."""
    return f"{article(kind)} {kind} tensor"


def verify_module(m: Module, *, data: bool = False) -> None:
    """Verify ``m``; with ``data=True`` also load tensor bytes and check hashes, code ranges and
    permutations (see ``qcompiler.ir.data_checks``)."""
    if not m.graphs:
        raise VerifyError("a module needs at least one graph", where=f"module @{m.name}", loc=m.loc)
    check_module_attrs(m)
    for g in m.graphs:
        verify_graph(m, g)
    check_invariants(m)
    if data:
        from qcompiler.ir.data_checks import check_data

        check_data(m)


def verify_graph(m: Module, g: Graph) -> None:
    where = f"graph @{g.name}"
    if not g.ops or g.ops[-1].name != "return":
        raise VerifyError("a graph must end with return(...)", where=where, loc=g.loc)
    defined: set[int] = set()
    for arg in g.args:
        check_type(arg.type, f"%{arg.name}", g)
        defined.add(id(arg))
    bound = value_bound(m)
    for i, op in enumerate(g.ops):
        if op.name == "return" and i != len(g.ops) - 1:
            raise VerifyError("return must be the last op of its graph", where=op.describe(), loc=op.loc)
        for v in op.operands:
            if id(v) not in defined:
                raise VerifyError(f"operand %{v.name} is used before it is defined", where=op.describe(), loc=op.loc)
        verify_op(m, op)
        check_size(op, bound)
        defined.update(id(r) for r in op.results)


MIN_VALUE_BOUND = 1 << 24
VALUE_FACTOR = 16
"""A value's static elements may be at most ``VALUE_FACTOR`` times the largest tensor of the module
(and ``MIN_VALUE_BOUND`` in any case): memory follows the largest tensor, so no graph may ask the
interpreter or runtime for a constant far larger than its weights (``full() {shape = [2**40]}``)."""


def value_bound(m: Module) -> int:
    largest = max((static_elements(DenseType(d.blob.dtype, d.blob.shape)) for d in m.tensors.values()), default=0)
    return max(MIN_VALUE_BOUND, VALUE_FACTOR * largest)


def check_size(op: Op, bound: int) -> None:
    for r in op.results:
        dense = r.type if isinstance(r.type, DenseType) else r.type.expressed
        if static_elements(dense) > bound:
            raise VerifyError(
                "value far larger than any tensor of the module",
                where=op.describe(),
                field=f"result %{r.name}",
                expected=f"at most {bound} static elements",
                found=dense.short(),
                loc=op.loc,
            )


def static_elements(t: DenseType) -> int:
    """The product of ``t``'s static dims (dynamic dims left out)."""
    n = 1
    for d in t.shape:
        n *= d if isinstance(d, int) else 1
    return n


def check_type(t: Type, where: str, at: Op | Graph, field: str = "type") -> None:
    """Static dims multiply to an int64 element count (every consumer counts elements in 64 bits);
    a quantized type also keeps the descriptor rules."""
    dense = t if isinstance(t, DenseType) else t.expressed
    if static_elements(dense) > INT64_MAX:
        raise VerifyError(
            "element count overflows int64",
            where=where,
            field=field,
            expected=f"at most {INT64_MAX} elements",
            found=dense.short(),
            loc=at.loc,
        )
    if not isinstance(t, QuantType):
        return
    try:
        check_descriptor(t)
    except DescriptorError as e:
        raise VerifyError(
            e.message, where=where, field=e.field, expected=e.expected, found=e.found, loc=at.loc
        ) from None


def verify_op(m: Module, op: Op) -> None:
    check_operands(op)
    check_attrs(op)
    check_results(op)
    for r in op.results:
        check_type(r.type, op.describe(), op, f"result %{r.name}")
    inferred = op.infer()
    if inferred is not None:
        for r, want in zip(op.results, inferred, strict=True):
            if not types_match(r.type, want):
                raise VerifyError(
                    "result type does not follow from the operands",
                    where=op.describe(),
                    field=f"result %{r.name}",
                    expected=str(want),
                    found=str(r.type),
                    loc=op.loc,
                )
    op.verify_(m)


def check_operands(op: Op) -> None:
    specs = op.operand_specs
    variadic = bool(specs) and specs[-1].variadic
    required = sum(1 for s in specs if not s.optional and not s.variadic)
    n = len(op.operands)
    if n < required or (not variadic and n > len(specs)):
        want = f"{required}..{len(specs)}" if required != len(specs) else str(required)
        if variadic:
            want = f"at least {required}"
        raise VerifyError("wrong number of operands", where=op.describe(), expected=want, found=str(n), loc=op.loc)
    for i, v in enumerate(op.operands):
        spec = specs[min(i, len(specs) - 1)]
        if not kind_ok(spec.kind, v.type):
            raise VerifyError(
                f"operand '{spec.name}' has the wrong kind of type",
                where=op.describe(),
                expected=kind_phrase(spec.kind),
                found=str(v.type),
                loc=op.loc,
            )


def check_results(op: Op) -> None:
    kinds = op.result_kinds
    if op.variadic_results:
        return
    if len(op.results) != len(kinds):
        raise VerifyError(
            "wrong number of results",
            where=op.describe(),
            expected=str(len(kinds)),
            found=str(len(op.results)),
            loc=op.loc,
        )
    for r, kind in zip(op.results, kinds, strict=True):
        if not kind_ok(kind, r.type):
            raise VerifyError(
                f"result %{r.name} has the wrong kind of type",
                where=op.describe(),
                expected=kind_phrase(kind),
                found=str(r.type),
                loc=op.loc,
            )


def check_attrs(op: Op) -> None:
    specs = {s.name: s for s in op.attr_specs}
    for spec in op.attr_specs:
        if spec.required and spec.name not in op.attrs:
            raise VerifyError(
                f"missing attribute '{spec.name}'",
                where=op.describe(),
                expected=f"{article(spec.kind)} {spec.kind}",
                found="nothing",
                loc=op.loc,
            )
    for name, value in op.attrs.items():
        spec = specs.get(name)
        if spec is None:
            if op.open_attrs:
                continue
            known = ", ".join(specs) or "none"
            raise VerifyError(
                f"unknown attribute '{name}'", where=op.describe(), expected=known, found=name, loc=op.loc
            )
        if not kind_matches(spec.kind, value):
            raise VerifyError(
                f"attribute '{name}' has the wrong kind",
                where=op.describe(),
                expected=spec.kind,
                found=attr_kind(value),
                loc=op.loc,
            )
        if spec.kind == "float" and isinstance(value, float) and math.isnan(value):
            raise VerifyError(
                "a float attribute must not be NaN",
                where=op.describe(),
                field=name,
                expected="a number or inf",
                found=format_attr(value),
                loc=op.loc,
            )
        if spec.choices and value not in spec.choices:
            raise VerifyError(
                f"attribute '{name}' is not one of the allowed values",
                where=op.describe(),
                expected=" | ".join(spec.choices),
                found=str(value),
                loc=op.loc,
            )

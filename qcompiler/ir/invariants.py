"""Named pipeline invariants, each a checkable predicate over a module.

A module claims invariants in ``attributes {invariants = [...]}``; passes add what they establish.
The verifier checks every claim, so a dump that says ``layouts-packed`` but holds a logical layout
is rejected. Register a new invariant with ``@invariant("name")``. The registered names are exactly
what the passes ``establish`` (a test holds the two sets equal); a claim outside them, or one
claimed twice, is refused.

- ``semantics-frozen``: every quantized value is a bound ``q.weight`` or an activation
  ``q.quantize`` of a non-constant (no codes invented from a float constant); the module records
  ``provenance``.
- ``axes-canonical``: every ``q.linear``/``q.embedding`` weight is ``[N, K]``/``[V, D]`` with groups
  along axis 1; no transpose is applied to a dequantized weight.
- ``shards-placed``: every tensor-table entry has a ``placement`` attribute.
- ``layouts-packed``: no quantized weight is still in the ``logical`` layout.
- ``qdq-fused``: in the ``fold`` form (module attribute ``qdq_form``, the default), no ``q.dequantize``
  of a ``q.weight`` feeds only ``linear``/``matmul``/``embedding``; in the ``materialize`` form no
  ``q.linear``/``q.embedding`` is left.
"""

from __future__ import annotations

from collections.abc import Callable

from qcompiler.errors import VerifyError
from qcompiler.ir.attrs import format_attr
from qcompiler.ir.core import Graph, Module, Op
from qcompiler.ir.module_attrs import QDQ_FOLD, QDQ_MATERIALIZE
from qcompiler.ir.ops.dense import Transpose
from qcompiler.ir.ops.quant import Dequantize, QEmbedding, QLinear, Quantize
from qcompiler.ir.types import QuantType

Checker = Callable[[Module], None]
INVARIANTS: dict[str, Checker] = {}


def invariant(name: str) -> Callable[[Checker], Checker]:
    def register(fn: Checker) -> Checker:
        if name in INVARIANTS:
            raise TypeError(f"invariant {name!r} registered twice")
        INVARIANTS[name] = fn
        return fn

    return register


def broken(name: str, op: Op, message: str) -> VerifyError:
    return VerifyError(message, where=op.describe(), field=f"invariant {name}", loc=op.loc)


def producers(g: Graph) -> dict[int, Op]:
    return {id(r): op for op in g.ops for r in op.results}


@invariant("semantics-frozen")
def _semantics_frozen(m: Module) -> None:
    if "provenance" not in m.attrs:
        raise VerifyError(
            "module claims frozen semantics but records no provenance",
            where=f"module @{m.name}",
            field="invariant semantics-frozen",
            loc=m.loc,
        )
    for g in m.graphs:
        made_by = producers(g)
        for op in g.ops:
            if isinstance(op, Quantize) and (src := made_by.get(id(op.x))) is not None and src.name == "const":
                raise broken("semantics-frozen", op, "quantizes a float constant: codes would be invented, not frozen")
            for r in op.results:
                if isinstance(r.type, QuantType) and op.name not in ("q.weight", "q.quantize", "test.producer"):
                    raise broken(
                        "semantics-frozen", op, f"produces a quantized value outside q.weight/q.quantize: %{r.name}"
                    )


@invariant("axes-canonical")
def _axes_canonical(m: Module) -> None:
    for g in m.graphs:
        made_by = producers(g)
        for op in g.ops:
            if isinstance(op, QLinear | QEmbedding):
                t = op.w.quant
                if t is not None and t.group is not None and t.group.axis != 1:
                    raise broken("axes-canonical", op, f"weight groups run along axis {t.group.axis}, not K (axis 1)")
            if isinstance(op, Transpose) and (src := made_by.get(id(op.x))) is not None and src.name == "q.dequantize":
                raise broken(
                    "axes-canonical", op, "transposes a dequantized weight; fold it into the [N, K] orientation"
                )


@invariant("shards-placed")
def _shards_placed(m: Module) -> None:
    for decl in m.tensors.values():
        if "placement" not in decl.attrs:
            raise VerifyError(
                "tensor has no placement", where=f"tensor @{decl.name}", field="invariant shards-placed", loc=decl.loc
            )


@invariant("layouts-packed")
def _layouts_packed(m: Module) -> None:
    for op in m.ops():
        t = op.results[0].quant if op.name == "q.weight" else None
        if t is not None and t.pack.family == "logical":
            raise broken("layouts-packed", op, "weight is still in the logical layout")


@invariant("qdq-fused")
def _qdq_fused(m: Module) -> None:
    form = m.attrs.get("qdq_form", QDQ_FOLD)
    for g in m.graphs:
        made_by, users = producers(g), g.users()
        for op in g.ops:
            if form == QDQ_MATERIALIZE and op.name in ("q.linear", "q.embedding"):
                raise broken(
                    "qdq-fused", op, "the module is in materialized QDQ form but still has a fused quantized op"
                )
            if not isinstance(op, Dequantize) or form != QDQ_FOLD:
                continue
            src = made_by.get(id(op.x))
            consumers = users.get(id(op.result), [])
            if (
                src is not None
                and src.name == "q.weight"
                and consumers
                and all(u.name in ("linear", "matmul", "embedding") for u in consumers)
            ):
                raise broken(
                    "qdq-fused",
                    op,
                    f"dequantized weight only feeds {consumers[0].name}; fuse it into q.{consumers[0].name}",
                )


def check_invariants(m: Module) -> None:
    raw = m.attrs.get("invariants")
    if raw is not None and (not isinstance(raw, list) or len(m.invariants) != len(raw)):
        raise VerifyError(
            "invariants must be a list of names",
            where=f"module @{m.name}",
            field="invariants",
            expected='["name", ...]',
            found=format_attr(raw),
            loc=m.loc,
        )
    seen: set[str] = set()
    for name in m.invariants:
        if name in seen:
            raise VerifyError(
                "an invariant is claimed twice",
                where=f"module @{m.name}",
                field="invariants",
                expected="each name once",
                found=name,
                loc=m.loc,
            )
        seen.add(name)
        checker = INVARIANTS.get(name)
        if checker is None:
            raise VerifyError(
                "unknown invariant",
                where=f"module @{m.name}",
                field="invariants",
                expected=" | ".join(INVARIANTS),
                found=name,
                loc=m.loc,
            )
        checker(m)

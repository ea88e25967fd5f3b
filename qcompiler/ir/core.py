"""The IR data model: module, tensor table, graphs of ops in SSA form, values with types.

A module holds a *tensor table* (lazy, content-addressed blobs: dtype, shape, sha256, location; the
bytes are never copied into the IR nor printed) and one or more graphs. A graph is a single block of
ops in SSA form, ending in ``return``::

    module @mlp attributes {invariants = []} {
      tensor @fc1.bias : f32[64] = blob<"sha256:9f86…", "mem">
      graph @forward(%x: tensor<f32[?batch,32]>) {
        %b = const() {ref = @fc1.bias} : tensor<f32[64]>
        ...
        return(%y)
      }
    }

Ops are classes registered by name (``Op.registry``); each declares its operands, results and
attributes and verifies itself (see ``qcompiler.ir.ops``). Operands and attributes are declared as
typed accessors (``qcompiler.ir.decls``), in order, and the class's ``operand_specs`` and
``attr_specs`` are built from them::

    class Sdpa(Op, name="sdpa"):
        q = operand("float")                # op.q: Value
        mask = optional_operand("dense")    # op.mask: Value | None (variadic_operand: list[Value])
        causal = attr(bool)                 # op.causal: bool
        scale = optional_attr(float)        # op.scale: float | None
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

from qcompiler.errors import SourceLocation
from qcompiler.ir.attrs import AttrValue
from qcompiler.ir.decls import (
    AttrDecl,
    AttrSpec,
    OperandDecl,
    OperandSpec,
    OptionalAttrDecl,
    OptionalOperandDecl,
    TypeKind,
    VariadicOperandDecl,
    attr,
    build_attr_specs,
    build_operand_specs,
    declares_attrs,
    declares_operands,
    dim_attr,
    narrow,
    operand,
    optional_attr,
    optional_operand,
    variadic_operand,
)
from qcompiler.ir.dtypes import DType
from qcompiler.ir.types import DenseType, QuantType, Type, format_shape

# --------------------------------------------------------------------------- tensor table


@dataclass(frozen=True)
class BlobRef:
    """A lazy, content-addressed tensor payload: what it is and where its bytes live.

    ``location`` schemes: ``mem`` (this process's blob store, by hash), ``file:REL[@OFFSET]``
    (raw little-endian bytes in a file relative to the IR file's directory); backends add more.
    """

    dtype: DType
    shape: tuple[int, ...]
    sha256: str
    location: str

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(eq=False)
class TensorDecl:
    """One tensor-table entry: ``tensor @name : i8[64,32] = blob<"sha256:…", "mem"> {attrs}``."""

    name: str
    blob: BlobRef
    attrs: dict[str, AttrValue] = field(default_factory=dict[str, AttrValue])
    comments: list[str] = field(default_factory=list[str])
    loc: SourceLocation | None = None

    def type_str(self) -> str:
        return f"{self.blob.dtype.name}{format_shape(self.blob.shape)}"


# --------------------------------------------------------------------------- values and ops


@dataclass(eq=False)
class Value:
    """An SSA value: defined once (by a graph argument or an op result), typed."""

    name: str
    type: Type
    producer: Op | None = None

    @property
    def dense(self) -> DenseType | None:
        return self.type if isinstance(self.type, DenseType) else None

    @property
    def quant(self) -> QuantType | None:
        return self.type if isinstance(self.type, QuantType) else None


class Op:
    """Base of every op. Subclasses register with ``class Linear(Op, name="linear")``.

    Class-level declarations: operands (``x = operand("float")``, which build ``operand_specs``) and
    attributes (``axis = attr(int)``, which build ``attr_specs``; a class may instead set either by
    hand), ``result_kinds`` (one kind per result, or ``variadic_results``). Per-op rules go in ``infer`` (return the
    result types the operands imply; the verifier checks the declared ones against them) and
    ``verify_`` (extra checks; raise ``VerifyError``).
    """

    name: ClassVar[str] = ""
    registry: ClassVar[dict[str, type[Op]]] = {}
    operand_specs: ClassVar[tuple[OperandSpec, ...]] = ()
    result_kinds: ClassVar[tuple[TypeKind, ...]] = ("dense",)
    variadic_results: ClassVar[bool] = False
    attr_specs: ClassVar[tuple[AttrSpec, ...]] = ()
    open_attrs: ClassVar[bool] = False
    """When true, attributes not declared in ``attr_specs`` are allowed (test ops, bindings)."""

    def __init_subclass__(cls, name: str = "", **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for what, declared in (("operand", declares_operands(cls)), ("attr", declares_attrs(cls))):
            if declared and f"{what}_specs" in vars(cls):
                raise TypeError(f"{cls.__qualname__}: declare {what}s as accessors or {what}_specs, not both")
        if declares_operands(cls):
            cls.operand_specs = build_operand_specs(cls, Op)
        if declares_attrs(cls):
            cls.attr_specs = build_attr_specs(cls, Op)
        if not name:
            return
        if name in Op.registry:
            raise TypeError(f"op {name!r} registered twice ({Op.registry[name].__qualname__}, {cls.__qualname__})")
        cls.name = name
        Op.registry[name] = cls

    def __init__(
        self,
        operands: list[Value],
        result_types: list[Type],
        attrs: dict[str, AttrValue] | None = None,
        result_names: list[str] | None = None,
    ) -> None:
        self.operands = list(operands)
        self.attrs: dict[str, AttrValue] = dict(attrs or {})
        names = result_names or [""] * len(result_types)
        self.results = [Value(n, t, self) for n, t in zip(names, result_types, strict=True)]
        self.comments: list[str] = []
        self.loc: SourceLocation | None = None

    @property
    def result(self) -> Value:
        """The single result (most ops have exactly one)."""
        return self.results[0]

    def infer(self) -> list[Type] | None:
        """Result types implied by operands and attributes; ``None`` when the op cannot say."""
        return None

    def verify_(self, module: Module) -> None:
        """Op-specific checks beyond the declarations (may consult the module); raise ``VerifyError``."""

    def operand(self, name: str) -> Value | None:
        """The operand declared as ``name`` (``None`` if it is optional and absent)."""
        for i, spec in enumerate(self.operand_specs):
            if spec.name == name:
                return self.operands[i] if i < len(self.operands) else None
        raise KeyError(name)

    def describe(self) -> str:
        """``%y = q.linear`` — how messages name this op."""
        if not self.results:
            return self.name
        return ", ".join(f"%{r.name}" for r in self.results) + f" = {self.name}"


def create_op(
    name: str,
    operands: list[Value],
    result_types: list[Type],
    attrs: dict[str, AttrValue] | None = None,
    result_names: list[str] | None = None,
) -> Op:
    """Instantiate a registered op by name (``KeyError`` if unknown)."""
    return Op.registry[name](operands, result_types, attrs, result_names)


# --------------------------------------------------------------------------- graphs and modules


@dataclass(eq=False)
class Graph:
    """A single-block SSA graph: typed arguments, then ops; the last op is ``return``."""

    name: str
    args: list[Value] = field(default_factory=list[Value])
    ops: list[Op] = field(default_factory=list[Op])
    comments: list[str] = field(default_factory=list[str])
    end_comments: list[str] = field(default_factory=list[str])
    loc: SourceLocation | None = None

    def users(self) -> dict[int, list[Op]]:
        """Map ``id(value)`` to the ops that use it, in program order."""
        out: dict[int, list[Op]] = {}
        for op in self.ops:
            for v in op.operands:
                out.setdefault(id(v), []).append(op)
        return out

    def values(self) -> Iterator[Value]:
        yield from self.args
        for op in self.ops:
            yield from op.results


@dataclass(eq=False)
class Module:
    """The unit the compiler works on: attributes, a tensor table, and graphs.

    ``attrs["invariants"]`` lists the pipeline invariants the module claims (``semantics-frozen``,
    ...); the verifier checks every claim, and the pass manager starts from them.
    """

    name: str
    attrs: dict[str, AttrValue] = field(default_factory=dict[str, AttrValue])
    tensors: dict[str, TensorDecl] = field(default_factory=dict[str, TensorDecl])
    graphs: list[Graph] = field(default_factory=list[Graph])
    comments: list[str] = field(default_factory=list[str])
    end_comments: list[str] = field(default_factory=list[str])
    trailer: list[str] = field(default_factory=list[str])
    loc: SourceLocation | None = None
    base_dir: str = ""
    """Directory that relative blob locations (``file:...``) resolve against; not printed."""

    @property
    def invariants(self) -> list[str]:
        claimed = self.attrs.get("invariants", [])
        if not isinstance(claimed, list):
            return []
        return [c for c in claimed if isinstance(c, str)]

    def set_invariants(self, names: list[str]) -> None:
        self.attrs["invariants"] = list[AttrValue](names)

    def ops(self) -> Iterator[Op]:
        for g in self.graphs:
            yield from g.ops

    def graph(self, name: str) -> Graph | None:
        return next((g for g in self.graphs if g.name == name), None)


__all__ = [
    "AttrDecl",
    "AttrSpec",
    "BlobRef",
    "Graph",
    "Module",
    "Op",
    "OperandDecl",
    "OperandSpec",
    "OptionalAttrDecl",
    "OptionalOperandDecl",
    "TensorDecl",
    "TypeKind",
    "Value",
    "VariadicOperandDecl",
    "attr",
    "create_op",
    "dim_attr",
    "narrow",
    "operand",
    "optional_attr",
    "optional_operand",
    "variadic_operand",
]

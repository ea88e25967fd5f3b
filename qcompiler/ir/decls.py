"""Declarations in an op's class body: operands and attributes as typed accessors.

``Op.__init_subclass__`` (``qcompiler.ir.core``) collects them, in declaration order, into the class's
``operand_specs`` and ``attr_specs``, the data the verifier reads::

    class Slice(Op, name="slice"):
        x = operand("dense")                 # op.x: Value
        axis = attr(int)                     # op.axis: int      (AttrSpec("axis", "int"))
        end = dim_attr()                     # op.end: int | str (AttrSpec("end", "dim"))
        scale = optional_attr(float)         # op.scale: float | None, an int value reads as float
        style = attr(str, choices=("half", "interleaved"))

On the class an accessor is its declaration; on an op it reads ``op.operands`` or ``op.attrs``, and an
attribute accessor also writes ``op.attrs[name]`` (an optional one set to ``None`` removes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, Self, TypeVar, cast, overload

from qcompiler.ir.attrs import AttrValue, SymbolRef, attr_kind
from qcompiler.ir.dtypes import DType

if TYPE_CHECKING:
    from qcompiler.ir.core import Op, Value

TypeKind = Literal["any", "dense", "float", "int", "quant"]
T = TypeVar("T")

OP_FIELDS = ("operands", "attrs", "results", "comments", "loc")
"""Set on every op by ``Op.__init__``: no accessor may take these names (nor a name ``Op`` has)."""


@dataclass(frozen=True)
class OperandSpec:
    """Declares one operand: name, type kind, and whether it is optional or variadic."""

    name: str
    kind: TypeKind = "any"
    optional: bool = False
    variadic: bool = False


@dataclass(frozen=True)
class AttrSpec:
    """Declares one attribute: name, value kind, whether required, and allowed choices."""

    name: str
    kind: str
    required: bool = True
    choices: tuple[str, ...] = ()


# --------------------------------------------------------------------------- operands


class _OperandDecl:
    """One operand declared in an op's class body; ``Op.__init_subclass__`` collects them in order."""

    optional: ClassVar[bool] = False
    variadic: ClassVar[bool] = False

    def __init__(self, kind: TypeKind = "any") -> None:
        self.kind: TypeKind = kind
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @property
    def spec(self) -> OperandSpec:
        return OperandSpec(self.name, self.kind, optional=self.optional, variadic=self.variadic)

    def index(self, op: Op) -> int:
        """This operand's position in ``op`` (its class's ``operand_specs`` may be set by hand)."""
        for i, spec in enumerate(op.operand_specs):
            if spec.name == self.name:
                return i
        raise AttributeError(f"{op.describe()} declares no operand '{self.name}'")


class OperandDecl(_OperandDecl):
    """A required operand: ``op.x`` is a ``Value``."""

    @overload
    def __get__(self, op: None, owner: type[Op]) -> Self: ...
    @overload
    def __get__(self, op: Op, owner: type[Op]) -> Value: ...
    def __get__(self, op: Op | None, owner: type[Op]) -> Value | Self:
        return self if op is None else op.operands[self.index(op)]


class OptionalOperandDecl(_OperandDecl):
    """An optional operand: ``op.bias`` is a ``Value``, or ``None`` when absent."""

    optional = True

    @overload
    def __get__(self, op: None, owner: type[Op]) -> Self: ...
    @overload
    def __get__(self, op: Op, owner: type[Op]) -> Value | None: ...
    def __get__(self, op: Op | None, owner: type[Op]) -> Value | Self | None:
        if op is None:
            return self
        i = self.index(op)
        return op.operands[i] if i < len(op.operands) else None


class VariadicOperandDecl(_OperandDecl):
    """A variadic (last) operand: ``op.xs`` is the ``list[Value]`` from its position on."""

    variadic = True

    @overload
    def __get__(self, op: None, owner: type[Op]) -> Self: ...
    @overload
    def __get__(self, op: Op, owner: type[Op]) -> list[Value]: ...
    def __get__(self, op: Op | None, owner: type[Op]) -> list[Value] | Self:
        return self if op is None else op.operands[self.index(op) :]


def operand(kind: TypeKind = "any") -> OperandDecl:
    """Declare a required operand in an op's class body: ``x = operand("float")``."""
    return OperandDecl(kind)


def optional_operand(kind: TypeKind = "any") -> OptionalOperandDecl:
    """Declare an optional operand: ``bias = optional_operand("float")``."""
    return OptionalOperandDecl(kind)


def variadic_operand(kind: TypeKind = "any") -> VariadicOperandDecl:
    """Declare a variadic operand (the last one): ``xs = variadic_operand("dense")``."""
    return VariadicOperandDecl(kind)


# --------------------------------------------------------------------------- attributes

ATTR_KINDS: dict[type, str] = {
    bool: "bool",
    int: "int",
    float: "float",
    str: "string",
    SymbolRef: "symbol",
    DType: "dtype",
    list: "list",
    dict: "dict",
}
"""The Python type an attribute accessor gives, and the verifier's kind name for it (``attr_kind``)."""


def kind_matches(kind: str, value: AttrValue) -> bool:
    """``float`` accepts ints; ``dim`` is an int or a ``"?name"`` dynamic size (the verifier's rule)."""
    found = attr_kind(value)
    if kind == "dim":
        return found == "int" or (isinstance(value, str) and value.startswith("?"))
    return found == kind or (kind == "float" and found == "int")


class _AttrDecl(Generic[T]):
    """One attribute declared in an op's class body; ``Op.__init_subclass__`` collects them in order."""

    required: ClassVar[bool] = True

    def __init__(self, kind: str, choices: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.choices = choices
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @property
    def spec(self) -> AttrSpec:
        return AttrSpec(self.name, self.kind, required=self.required, choices=self.choices)

    def read(self, op: Op) -> T | None:
        """The value (``None`` when absent); a value of another kind is a ``TypeError``."""
        value = op.attrs.get(self.name)
        if value is None:
            return None
        if not kind_matches(self.kind, value):
            raise TypeError(f"{op.describe()}: attribute '{self.name}' is {attr_kind(value)}, expected {self.kind}")
        if self.kind == "float":
            return cast(T, float(cast(float, value)))
        return cast(T, value)

    def __set__(self, op: Op, value: T) -> None:
        op.attrs[self.name] = cast(AttrValue, value)


class AttrDecl(_AttrDecl[T]):
    """A required attribute: ``op.axis`` is its value (missing: an ``AttributeError`` naming op and attribute)."""

    @overload
    def __get__(self, op: None, owner: type[Op]) -> Self: ...
    @overload
    def __get__(self, op: Op, owner: type[Op]) -> T: ...
    def __get__(self, op: Op | None, owner: type[Op]) -> T | Self:
        if op is None:
            return self
        value = self.read(op)
        if value is None:
            raise AttributeError(f"{op.describe()}: missing attribute '{self.name}' (a required {self.kind})")
        return value


class OptionalAttrDecl(_AttrDecl[T | None]):
    """An optional attribute: ``op.scale`` is its value, or ``None`` when absent (setting ``None`` removes it)."""

    required = False

    @overload
    def __get__(self, op: None, owner: type[Op]) -> Self: ...
    @overload
    def __get__(self, op: Op, owner: type[Op]) -> T | None: ...
    def __get__(self, op: Op | None, owner: type[Op]) -> T | Self | None:
        return self if op is None else self.read(op)

    def __set__(self, op: Op, value: T | None) -> None:
        if value is None:
            op.attrs.pop(self.name, None)
        else:
            op.attrs[self.name] = cast(AttrValue, value)


def _kind(t: type) -> str:
    kind = ATTR_KINDS.get(t)
    if kind is None:
        raise TypeError(f"no attribute kind for {t.__qualname__} (one of {', '.join(k.__name__ for k in ATTR_KINDS)})")
    return kind


@overload
def attr(t: type[list[Any]], *, choices: tuple[str, ...] = ()) -> AttrDecl[list[AttrValue]]: ...
@overload
def attr(t: type[dict[Any, Any]], *, choices: tuple[str, ...] = ()) -> AttrDecl[dict[str, AttrValue]]: ...
@overload
def attr(t: type[T], *, choices: tuple[str, ...] = ()) -> AttrDecl[T]: ...
def attr(t: type, *, choices: tuple[str, ...] = ()) -> AttrDecl[Any]:
    """Declare a required attribute by its Python type: ``axis = attr(int)``, ``mode = attr(str, choices=(...))``."""
    return AttrDecl[Any](_kind(t), choices)


@overload
def optional_attr(t: type[list[Any]], *, choices: tuple[str, ...] = ()) -> OptionalAttrDecl[list[AttrValue]]: ...
@overload
def optional_attr(
    t: type[dict[Any, Any]], *, choices: tuple[str, ...] = ()
) -> OptionalAttrDecl[dict[str, AttrValue]]: ...
@overload
def optional_attr(t: type[T], *, choices: tuple[str, ...] = ()) -> OptionalAttrDecl[T]: ...
def optional_attr(t: type, *, choices: tuple[str, ...] = ()) -> OptionalAttrDecl[Any]:
    """Declare an optional attribute: ``scale = optional_attr(float)`` (``op.scale`` is ``None`` when absent)."""
    return OptionalAttrDecl[Any](_kind(t), choices)


def dim_attr() -> AttrDecl[int | str]:
    """Declare a required size attribute, an int or a dynamic ``"?name"``: ``end = dim_attr()``."""
    return AttrDecl[int | str]("dim")


OpT = TypeVar("OpT")


def narrow(op: Op, cls: type[OpT]) -> OpT:
    """``op`` as an instance of ``cls``, for code that dispatched on its name (another is a ``TypeError``)."""
    if not isinstance(op, cls):
        raise TypeError(f"{op.describe()} is not a {cls.__qualname__}")
    return op


# --------------------------------------------------------------------------- building the specs

S = TypeVar("S", OperandSpec, AttrSpec)


def _check_name(cls: type, base: type, what: str, name: str) -> None:
    if hasattr(base, name) or name in OP_FIELDS:
        raise TypeError(f"{cls.__qualname__}: {what} '{name}' would hide Op.{name}")


def _merged(
    cls: type[Op], base: type[Op], inherited: tuple[S, ...], decls: list[Any], what: str, other: set[str]
) -> list[S]:
    """``inherited`` specs, then the spec of each of ``decls`` (a redeclared name keeps its place); a
    declared name may not hide ``Op``'s own nor be among the ``other`` kind's names."""
    specs = list(inherited)
    for decl in decls:
        _check_name(cls, base, what, decl.name)
        if decl.name in other:
            kind = "attribute" if what == "operand" else "operand"
            raise TypeError(f"{cls.__qualname__}: {what} '{decl.name}' has the name of an {kind}")
        names = [s.name for s in specs]
        if decl.name in names:
            specs[names.index(decl.name)] = decl.spec
        else:
            specs.append(decl.spec)
    return specs


def build_operand_specs(cls: type[Op], base: type[Op]) -> tuple[OperandSpec, ...]:
    """The inherited specs (not yet in ``cls``'s own namespace: the base's), then the operands ``cls``
    declares."""
    decls = [v for v in vars(cls).values() if isinstance(v, _OperandDecl)]
    specs = _merged(cls, base, cls.operand_specs, decls, "operand", {s.name for s in cls.attr_specs})
    if any(s.variadic for s in specs[:-1]):
        raise TypeError(f"{cls.__qualname__}: only the last operand may be variadic")
    return tuple(specs)


def build_attr_specs(cls: type[Op], base: type[Op]) -> tuple[AttrSpec, ...]:
    """The inherited specs, then the attributes ``cls`` declares."""
    decls = [v for v in vars(cls).values() if isinstance(v, _AttrDecl)]
    return tuple(_merged(cls, base, cls.attr_specs, decls, "attribute", {s.name for s in cls.operand_specs}))


def declares_operands(cls: type) -> bool:
    """Whether ``cls``'s own body declares an operand accessor."""
    return any(isinstance(v, _OperandDecl) for v in vars(cls).values())


def declares_attrs(cls: type) -> bool:
    """Whether ``cls``'s own body declares an attribute accessor."""
    return any(isinstance(v, _AttrDecl) for v in vars(cls).values())


__all__ = [
    "ATTR_KINDS",
    "AttrDecl",
    "AttrSpec",
    "OperandDecl",
    "OperandSpec",
    "OptionalAttrDecl",
    "OptionalOperandDecl",
    "TypeKind",
    "VariadicOperandDecl",
    "attr",
    "build_attr_specs",
    "build_operand_specs",
    "declares_attrs",
    "declares_operands",
    "dim_attr",
    "kind_matches",
    "narrow",
    "operand",
    "optional_attr",
    "optional_operand",
    "variadic_operand",
]

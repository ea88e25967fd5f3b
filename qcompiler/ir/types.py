"""IR types: dense tensors and quantized tensors whose type *is* the logical descriptor.

Dense tensor, with a dynamic named dimension::

    tensor<f32[?batch,?seq,64]>

Quantized tensor (one line in the IR; wrapped here for reading)::

    !q.affine<i4[-8:7] -> f32[64,96], unit=element, rev=1,
              group=(axis=1, size=32, tail=partial), qparams={scale: f16[64,3], zero: i8[64,3]},
              decoder=1, pack=(family=logical, version=1, encoding=none, tile=[1,1]), req=linear,
              rate=(bits=29184, per=6144, unit=weight, scope=tensor, incl=[codes, scale, zero])>

reads: codes are signed 4-bit integers in [-8, 7], one per element; they decode (family ``affine``,
decoder version 1) to an f32 tensor of shape [64, 96]; groups of 32 along axis 1, a short tail group
if 96 were not a multiple of 32; per-group f16 scales and i8 zero points; stored in the logical
layout (one code per byte, not packed yet); meant for a linear operator; the claimed rate is 4.75
bits per weight (6144 codes of 4 bits, 192 scales of 16, 192 zero points of 8). Rate claims are
accounting only, never a dispatch key, but the verifier recomputes them (``descriptor.rate_claim``).

Types are frozen and hashable; two weights with the same descriptor share one type value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from qcompiler.ir.dtypes import CodeDType, DType

Dim = int | str
"""A dimension: a static size, or a dynamic one spelled ``?`` or ``?name``."""


def is_dynamic(dim: Dim) -> bool:
    return isinstance(dim, str)


def dims_match(a: Dim, b: Dim) -> bool:
    """Equal, or either is dynamic (a dynamic dim matches any size)."""
    return a == b or is_dynamic(a) or is_dynamic(b)


def shapes_match(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> bool:
    return len(a) == len(b) and all(dims_match(x, y) for x, y in zip(a, b, strict=True))


def format_shape(shape: tuple[Dim, ...]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class DenseType:
    """A dense tensor: element dtype and shape (static ints or dynamic ``?name`` dims)."""

    dtype: DType
    shape: tuple[Dim, ...]

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return not any(is_dynamic(d) for d in self.shape)

    def numel(self) -> int | None:
        if not self.is_static:
            return None
        return prod(int(d) for d in self.shape)

    def short(self) -> str:
        """The form used inside quantized types and tensor tables: ``f16[64,1]``."""
        return f"{self.dtype.name}{format_shape(self.shape)}"

    def __str__(self) -> str:
        return f"tensor<{self.short()}>"


@dataclass(frozen=True)
class Alphabet:
    """The set of code values: an inclusive range ``[lo:hi]`` or an explicit set ``{-1,0,1}``."""

    lo: int
    hi: int
    values: tuple[int, ...] | None = None

    @staticmethod
    def range(lo: int, hi: int) -> Alphabet:
        return Alphabet(lo, hi)

    @staticmethod
    def of(values: tuple[int, ...]) -> Alphabet:
        return Alphabet(min(values), max(values), tuple(values))

    def __str__(self) -> str:
        if self.values is not None:
            return "{" + ",".join(str(v) for v in self.values) + "}"
        return f"[{self.lo}:{self.hi}]"


@dataclass(frozen=True)
class CodeContract:
    """What a code is: integer type (bits, signedness), alphabet, selection unit, decoder revision."""

    dtype: CodeDType
    alphabet: Alphabet
    unit: str = "element"
    rev: int = 1

    def head(self) -> str:
        return f"{self.dtype.name}{self.alphabet}"


TAIL_RULES = ("partial", "pad")
"""How a last group shorter than ``size`` is treated: kept short, or padded with zero codes."""


@dataclass(frozen=True)
class GroupSpec:
    """Groups of ``size`` consecutive elements along ``axis`` share qparams."""

    axis: int
    size: int
    tail: str = "partial"

    def __str__(self) -> str:
        return f"(axis={self.axis}, size={self.size}, tail={self.tail})"


@dataclass(frozen=True)
class PackSpec:
    """The physical layout of the codes: ``(family, version, encoding, tile)``.

    ``logical`` v1 is the unpacked layout (one code per byte, logical shape) that every tensor has
    before ``pack-layouts`` picks a target layout.
    """

    family: str = "logical"
    version: int = 1
    encoding: str = "none"
    tile: tuple[int, ...] = (1, 1)

    def __str__(self) -> str:
        tile = "[" + ",".join(str(t) for t in self.tile) + "]"
        return f"(family={self.family}, version={self.version}, encoding={self.encoding}, tile={tile})"


@dataclass(frozen=True)
class RateClaim:
    """``bits`` per ``per`` ``unit`` (e.g. 144 bits per 32 weights), counted over ``scope``.

    ``incl`` lists what the bits include (``codes``, qparam names, ``exceptions``, ``metadata``).
    Accounting only: never consulted for dispatch.
    """

    bits: int
    per: int
    unit: str = "weight"
    scope: str = "tensor"
    incl: tuple[str, ...] = ("codes",)

    def __str__(self) -> str:
        return (
            f"(bits={self.bits}, per={self.per}, unit={self.unit}, scope={self.scope}, incl=[{', '.join(self.incl)}])"
        )


Slot = tuple[str, "DenseType | QuantType"]
"""A named component tensor of a descriptor (qparam, exception or transform tensor)."""


def format_slots(slots: tuple[Slot, ...]) -> str:
    return "{" + ", ".join(f"{name}: {slot_type_str(t)}" for name, t in slots) + "}"


def slot_type_str(t: DenseType | QuantType) -> str:
    return t.short() if isinstance(t, DenseType) else str(t)


@dataclass(frozen=True)
class QuantType:
    """A quantized tensor type: the full logical descriptor (see the module docstring for the syntax).

    ``qparams`` slots may themselves be quantized (nested / hierarchical qparams, e.g. K-quant
    sub-block scales quantized against a super-block scale).
    """

    family: str
    code: CodeContract
    expressed: DenseType
    group: GroupSpec | None = None
    qparams: tuple[Slot, ...] = ()
    exceptions: tuple[Slot, ...] = ()
    transforms: tuple[Slot, ...] = ()
    perm: DenseType | None = None
    decoder: int = 1
    pack: PackSpec = field(default_factory=PackSpec)
    req: str = "any"
    rate: RateClaim | None = None

    @property
    def shape(self) -> tuple[Dim, ...]:
        return self.expressed.shape

    @property
    def rank(self) -> int:
        return self.expressed.rank

    def qparam(self, name: str) -> DenseType | QuantType | None:
        return dict(self.qparams).get(name)

    def slots(self) -> dict[str, DenseType | QuantType]:
        """Every component tensor by binding name: qparams, exceptions, transforms, ``perm``."""
        out: dict[str, DenseType | QuantType] = dict(self.qparams)
        out.update(self.exceptions)
        out.update(self.transforms)
        if self.perm is not None:
            out["perm"] = self.perm
        return out

    def short(self) -> str:
        return str(self)

    def __str__(self) -> str:
        parts = [
            f"{self.code.head()} -> {self.expressed.short()}",
            f"unit={self.code.unit}",
            f"rev={self.code.rev}",
        ]
        if self.group is not None:
            parts.append(f"group={self.group}")
        parts.append(f"qparams={format_slots(self.qparams)}")
        if self.exceptions:
            parts.append(f"exceptions={format_slots(self.exceptions)}")
        if self.transforms:
            parts.append(f"transforms={format_slots(self.transforms)}")
        if self.perm is not None:
            parts.append(f"perm={self.perm.short()}")
        parts += [f"decoder={self.decoder}", f"pack={self.pack}", f"req={self.req}"]
        if self.rate is not None:
            parts.append(f"rate={self.rate}")
        return f"!q.{self.family}<{', '.join(parts)}>"


Type = DenseType | QuantType

"""Element types, as one table.

``DTYPES`` maps the IR spelling (``f32``, ``bf16``, ``i8``) to its facts: width in bits, kind, and
the numpy dtype name used to hold it in memory (``bfloat16`` has no numpy type and is held as raw
``uint16``). Code alphabets use the same integer spellings at any width 1..8 (``i4``, ``u2``); those
are *code* types and are stored in the ``i8``/``u8`` container types.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Kind = Literal["float", "int", "uint", "bool"]


@dataclass(frozen=True)
class DType:
    """A storage/element type. ``name`` is the IR spelling."""

    name: str
    bits: int
    kind: Kind
    numpy: str

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_integer(self) -> bool:
        return self.kind in ("int", "uint")

    @property
    def itemsize(self) -> int:
        return max(1, self.bits // 8)

    def __str__(self) -> str:
        return self.name


# name: (bits, kind, numpy container)
_TABLE: dict[str, tuple[int, Kind, str]] = {
    "f64": (64, "float", "float64"),
    "f32": (32, "float", "float32"),
    "f16": (16, "float", "float16"),
    "bf16": (16, "float", "uint16"),
    "f8e4m3": (8, "float", "uint8"),
    "f8e5m2": (8, "float", "uint8"),
    "i64": (64, "int", "int64"),
    "i32": (32, "int", "int32"),
    "i16": (16, "int", "int16"),
    "i8": (8, "int", "int8"),
    "u64": (64, "uint", "uint64"),
    "u32": (32, "uint", "uint32"),
    "u16": (16, "uint", "uint16"),
    "u8": (8, "uint", "uint8"),
    "bool": (8, "bool", "bool"),
}

DTYPES: dict[str, DType] = {name: DType(name, b, k, np) for name, (b, k, np) in _TABLE.items()}

FLOAT_MAX: dict[str, float] = {
    "f64": 1.7976931348623157e308,
    "f32": 3.4028234663852886e38,
    "f16": 65504.0,
    "bf16": 3.3895313892515355e38,
    "f8e4m3": 448.0,
    "f8e5m2": 57344.0,
}
"""The largest finite value of each float dtype: a finite literal beyond it overflows."""


def representable(value: float, d: DType) -> bool:
    """Whether the literal ``value`` is one ``d`` can hold: for floats any NaN or infinity, or a finite
    value up to the dtype's largest; for integers an integral value in range; for bool 0 or 1."""
    if d.kind == "float":
        return value != value or abs(value) == float("inf") or abs(value) <= FLOAT_MAX[d.name]
    if value != value or abs(value) == float("inf") or value != int(value):
        return False
    if d.kind == "bool":
        return value in (0, 1)
    lo, hi = (-(1 << (d.bits - 1)), (1 << (d.bits - 1)) - 1) if d.kind == "int" else (0, (1 << d.bits) - 1)
    return lo <= int(value) <= hi


_CODE_RE = re.compile(r"^([iu])([1-8])$")


def dtype(name: str) -> DType:
    """Look up a storage dtype by its IR spelling; raises ``KeyError`` for unknown names."""
    return DTYPES[name]


@dataclass(frozen=True)
class CodeDType:
    """An integer code type of 1..8 bits (``i4``, ``u2``): what a quantized code is, not how it is stored."""

    signed: bool
    bits: int

    @property
    def name(self) -> str:
        return f"{'i' if self.signed else 'u'}{self.bits}"

    @property
    def min(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def max(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1

    @property
    def container(self) -> DType:
        """The one-code-per-byte storage type of the logical (unpacked) layout."""
        return DTYPES["i8" if self.signed else "u8"]

    def __str__(self) -> str:
        return self.name


def code_dtype(name: str) -> CodeDType | None:
    """Parse ``i4``/``u8``-style code type spellings; ``None`` if ``name`` is not one."""
    m = _CODE_RE.match(name)
    if m is None:
        return None
    return CodeDType(signed=m.group(1) == "i", bits=int(m.group(2)))

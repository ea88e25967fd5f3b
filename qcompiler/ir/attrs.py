"""Attribute values attached to ops, tensors and modules.

Syntax (inside ``{...}`` after an op's operands)::

    {axis = -1, eps = 1e-05, approximate = "tanh", perm = [1, 0], ref = @fc1.bias, dtype = f16,
     causal = true, bind = {codes = @w.codes, scale = @w.scale}}

Kinds: int, float (always printed with a ``.``, ``e``, ``inf`` or ``nan``), string, bool, symbol
reference ``@name``, dtype name, list, and dict. Floats print with ``repr`` so they round-trip exactly.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from qcompiler.ir.dtypes import DType

_PLAIN_SYMBOL = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./\-]*$")


@dataclass(frozen=True)
class SymbolRef:
    """A reference to a tensor-table entry (or module-level symbol): ``@fc1.weight``."""

    name: str

    def __str__(self) -> str:
        return f"@{self.name}" if _PLAIN_SYMBOL.match(self.name) else f"@{format_string(self.name)}"


AttrValue = int | float | str | bool | SymbolRef | DType | list["AttrValue"] | dict[str, "AttrValue"]


def format_float(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return repr(v)


def format_string(s: str) -> str:
    escaped = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def format_attr(v: AttrValue) -> str:
    """Print one attribute value in its canonical form."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return format_float(v)
    if isinstance(v, str):
        return format_string(v)
    if isinstance(v, SymbolRef | DType):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(format_attr(x) for x in v) + "]"
    return format_attr_dict(v)


def format_attr_dict(d: dict[str, AttrValue]) -> str:
    return "{" + ", ".join(f"{k} = {format_attr(v)}" for k, v in d.items()) + "}"


def attr_kind(v: AttrValue) -> str:
    """A short kind name for messages and constraint checks."""
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "string"
    if isinstance(v, SymbolRef):
        return "symbol"
    if isinstance(v, DType):
        return "dtype"
    if isinstance(v, list):
        return "list"
    return "dict"

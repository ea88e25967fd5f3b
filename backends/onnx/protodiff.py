"""The first difference between two ONNX protobuf messages, named for a reader's error message.

``first_difference(want, found)`` walks the fields of ``want``'s descriptor in field-number order and
returns the first one whose value or presence differs, as a ``Difference``: the initializer it is in
(if any), a path to the field and both values, shortened. Repeated messages that carry a name
(nodes, initializers, inputs, outputs, attributes, ``external_data`` entries) are compared by their
names first, so an extra, a missing or a reordered entry is reported as such rather than as a
difference of every entry after it:

| where | reported as |
|---|---|
| a model field | ``ir_version``, ``opset_import[1].version`` ... |
| an initializer | tensor ``W.B``, field ``dims``, ``raw_data``, ``external_data.offset`` ... |
| a node | ``graph.node[12] 'mul_86'.attribute['K'].i`` |
| an entry present in one list only | ``graph.initializer``: ``extra 'x'`` / ``missing 'x'`` |
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

SHOWN = 80
"""Characters of a value shown in a message."""
INITIALIZER = "graph.initializer"


@dataclass(frozen=True)
class Difference:
    """Where two models first differ: ``tensor`` (an initializer's name, or empty) and ``field``."""

    tensor: str
    field: str
    expected: str
    found: str


def show(value: object) -> str:
    """A value for a message: bytes by size and digest, long text cut at ``SHOWN`` characters."""
    if isinstance(value, bytes):
        return f"{len(value)} bytes, sha256 {hashlib.sha256(value).hexdigest()[:16]}"
    text = repr(value)
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


def first_byte(a: bytes, b: bytes) -> int:
    """The index of the first byte where ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    n = min(len(a), len(b))
    differs = np.flatnonzero(np.frombuffer(a, np.uint8, n) != np.frombuffer(b, np.uint8, n))
    return int(differs[0]) if differs.size else n


def label(m: Message) -> str | None:
    """What names an entry of a repeated field: its ``name`` (or ``key``), if it has one."""
    for field in ("name", "key"):
        if field in m.DESCRIPTOR.fields_by_name:
            value: object = getattr(m, field)
            return value if isinstance(value, str) else repr(value)
    return None


def first_difference(want: Message, found: Message, path: str = "", tensor: str = "") -> Difference | None:
    """The first field in which ``found`` differs from ``want`` (None when every known field is equal);
    ``path`` and ``tensor`` say where the two messages are (for the result)."""
    if want == found:
        return None
    keyed = "key" in want.DESCRIPTOR.fields_by_name
    for fd in sorted(want.DESCRIPTOR.fields, key=lambda f: f.number):
        at = path if keyed and fd.name == "value" else f"{path}.{fd.name}" if path else fd.name
        a: Any = getattr(want, fd.name)
        b: Any = getattr(found, fd.name)
        if fd.is_repeated:
            d = _repeated(fd.type == FieldDescriptor.TYPE_MESSAGE, list(a), list(b), at, tensor)
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            d = _presence(want, found, fd.name, at, tensor) or first_difference(a, b, at, tensor)
        else:
            d = _presence(want, found, fd.name, at, tensor) or (None if a == b else _leaf(tensor, at, a, b))
        if d is not None:
            return d
    return None


def _presence(want: Message, found: Message, name: str, at: str, tensor: str) -> Difference | None:
    has_a, has_b = want.HasField(name), found.HasField(name)
    if has_a == has_b:
        return None
    return Difference(tensor, at, "set" if has_a else "absent", "set" if has_b else "absent")


def _repeated(messages: bool, a: list[Any], b: list[Any], at: str, tensor: str) -> Difference | None:
    if not messages:
        return None if a == b else _leaf(tensor, at, a, b)
    names_a = [label(x) for x in a]
    names_b = [label(x) for x in b]
    if names_a != names_b and None not in names_a:
        return _names(at, [str(n) for n in names_a], [str(n) for n in names_b])
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        name = names_a[i]
        if at == INITIALIZER and name is not None:
            d = first_difference(x, y, "", name)
        else:
            d = first_difference(x, y, _entry(at, i, name), tensor)
        if d is not None:
            return d
    return None if len(a) == len(b) else _leaf(tensor, at, f"{len(a)} entries", f"{len(b)} entries")


def _entry(at: str, i: int, name: str | None) -> str:
    if name is None:
        return f"{at}[{i}]"
    if at.endswith("external_data"):
        return f"{at}.{name}"
    if at.endswith(("attribute", "metadata_props")):
        return f"{at}[{name!r}]"
    return f"{at}[{i}] {name!r}"


def _names(at: str, a: list[str], b: list[str]) -> Difference:
    """The first entry where two named lists part: one present in one list only, or out of order."""
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        if x == y:
            continue
        if y is not None and y not in a:
            return Difference(y if at == INITIALIZER else "", at, "no such entry", f"extra {y!r} at position {i}")
        if x is not None and x not in b:
            return Difference(x if at == INITIALIZER else "", at, f"{x!r} at position {i}", "missing")
        return Difference(x or "" if at == INITIALIZER else "", f"{at}[{i}]", f"{x!r} here", f"{y!r} (out of order)")
    return Difference("", at, show(a), show(b))


def _leaf(tensor: str, at: str, a: object, b: object) -> Difference:
    if isinstance(a, bytes) and isinstance(b, bytes):
        return Difference(tensor, at, show(a), f"{show(b)}, first difference at byte {first_byte(a, b)}")
    return Difference(tensor, at, show(a), show(b))

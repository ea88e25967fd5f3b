"""Invariants of a quantized descriptor that hold without looking at any bytes.

``check_descriptor(t)`` raises ``DescriptorError(field, message, expected, found)``; the verifier
adds the op or tensor it belongs to. Rules, in order:

- the family is registered, its decoder version is known, its own rule holds;
- the alphabet fits the code type and the expressed dtype is a float;
- the group axis is in range, the size positive, the tail rule known;
- qparam slots are exactly the family's (required present, nothing unknown), and each has the shape
  of the tensor with the group axis replaced by ``ceil(K / G)`` (all ones when per-tensor);
  quantized (nested) slots only where the family allows them, checked recursively;
- the permutation is rank 1 and as long as the group axis, with an integer dtype;
- the layout ``(family, version)`` is registered, knows the encoding, and its tile divides the
  padded shape (group axis padded to a whole number of groups when ``tail=pad``);
- operator requirement, selection unit and rate claim use known words, and the rate counts only
  parts the descriptor has, each once;
- the rate claim is true: ``rate_claim`` recomputes it from the descriptor (over ``scope=tensor``
  exactly, over a group or block as the same ratio); a claim over the artifact, or on a descriptor
  with dynamic dims, cannot be checked and is refused.

A W4 g32 ``[64,64]`` weight with f32 scales ``[64,2]`` stores ``4096*4 + 128*32`` bits::

    rate=(bits=20480, per=4096, unit=weight, scope=tensor, incl=[codes, scale])   // true
    rate=(bits=20480, per=127, unit=weight, scope=tensor, incl=[codes, scale])    // refused
"""

from __future__ import annotations

from math import prod

from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.families import QPARAM_USES, RATE_SCOPES, RATE_UNITS, SELECTION_UNITS, Family
from qcompiler.ir.layouts import find_layout
from qcompiler.ir.types import (
    TAIL_RULES,
    DenseType,
    Dim,
    QuantType,
    RateClaim,
    Slot,
    ceil_div,
    format_shape,
    is_dynamic,
    shapes_match,
)


class DescriptorError(Exception):
    def __init__(self, field: str, message: str, expected: object = "", found: object = "") -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.expected = str(expected)
        self.found = str(found)


def expected_qparam_shape(t: QuantType) -> tuple[Dim, ...]:
    """``shape`` with the group axis replaced by ``ceil(K / G)``; all ones for per-tensor."""
    if t.group is None:
        return tuple(1 for _ in t.shape)
    dim = t.shape[t.group.axis]
    groups: Dim = "?" if is_dynamic(dim) else ceil_div(int(dim), t.group.size)
    return tuple(groups if i == t.group.axis else d for i, d in enumerate(t.shape))


def padded_shape(t: QuantType) -> tuple[Dim, ...]:
    if t.group is None or t.group.tail != "pad":
        return t.shape
    dim = t.shape[t.group.axis]
    if is_dynamic(dim):
        return t.shape
    padded = ceil_div(int(dim), t.group.size) * t.group.size
    return tuple(padded if i == t.group.axis else d for i, d in enumerate(t.shape))


def check_descriptor(t: QuantType) -> None:
    family = Family.registry.get(t.family)
    if family is None:
        raise DescriptorError("family", "unknown representation family", " | ".join(sorted(Family.registry)), t.family)
    _check_code(t, family)
    _check_group(t)
    _check_slots(t, family)
    _check_perm(t)
    _check_pack(t)
    _check_words(t)
    if (problem := family.check(t)) is not None:
        raise DescriptorError(*problem)
    _check_rate(t)


def _check_code(t: QuantType, family: type[Family]) -> None:
    c = t.code
    if not t.expressed.dtype.is_float:
        floats = " | ".join(d.name for d in DTYPES.values() if d.is_float)
        raise DescriptorError("expressed", "quantized tensors decode to a float dtype", floats, t.expressed.dtype)
    if c.alphabet.lo > c.alphabet.hi:
        raise DescriptorError("code", "empty alphabet range", "lo <= hi", c.alphabet)
    if c.alphabet.lo < c.dtype.min or c.alphabet.hi > c.dtype.max:
        raise DescriptorError(
            "code", f"alphabet does not fit {c.dtype.name}", f"within [{c.dtype.min}:{c.dtype.max}]", c.alphabet
        )
    if c.alphabet.values is not None and len(set(c.alphabet.values)) != len(c.alphabet.values):
        raise DescriptorError("code", "alphabet lists a value twice", "distinct values", c.alphabet)
    if c.rev < 1:
        raise DescriptorError("rev", "code contract revision must be positive", ">= 1", c.rev)
    if t.decoder not in family.decoders:
        known = ", ".join(str(d) for d in family.decoders)
        raise DescriptorError("decoder", f"unknown decoder version for family {t.family}", known, t.decoder)


def _check_group(t: QuantType) -> None:
    g = t.group
    if g is None:
        return
    if not 0 <= g.axis < t.rank:
        raise DescriptorError("group", "group axis out of range", f"in [0, {t.rank - 1}]", g.axis)
    if g.size < 1:
        raise DescriptorError("group", "group size must be positive", ">= 1", g.size)
    if g.tail not in TAIL_RULES:
        raise DescriptorError("group", "unknown tail rule", " | ".join(TAIL_RULES), g.tail)


def _check_slots(t: QuantType, family: type[Family]) -> None:
    names = [n for n, _ in t.qparams]
    for need in family.required:
        if need not in names:
            raise DescriptorError(
                "qparams", f"family {t.family} requires qparam '{need}'", need, ", ".join(names) or "none"
            )
    allowed = family.required + family.optional
    for name in names:
        if name not in allowed:
            raise DescriptorError("qparams", f"family {t.family} has no qparam '{name}'", " | ".join(allowed), name)
    want = expected_qparam_shape(t)
    for name, slot in t.qparams:
        _check_qparam(t, family, name, slot, want)
    _check_named_slots(t, "exceptions", t.exceptions, family.exceptions, exact=True)
    _check_named_slots(t, "transforms", t.transforms, family.transforms, exact=False)


def _check_qparam(
    t: QuantType, family: type[Family], name: str, slot: DenseType | QuantType, want: tuple[Dim, ...]
) -> None:
    field = f"qparam '{name}'"
    shape = slot.shape
    per_tensor_scalar = t.group is None and shape == ()
    if not shapes_match(shape, want) and not per_tensor_scalar:
        raise DescriptorError(
            field,
            "shape must be the tensor shape with ceil(K/G) along the group axis",
            format_shape(want),
            format_shape(shape),
        )
    if isinstance(slot, DenseType):
        return
    if not family.nested:
        raise DescriptorError(
            field, f"family {t.family} does not allow quantized (nested) qparams", "a dense type", slot.family
        )
    try:
        check_descriptor(slot)
    except DescriptorError as e:
        raise DescriptorError(f"{field} {e.field}", e.message, e.expected, e.found) from None


def _check_named_slots(
    t: QuantType, field: str, slots: tuple[Slot, ...], allowed: tuple[str, ...], exact: bool
) -> None:
    names = [n for n, _ in slots]
    for name, slot in slots:
        if name not in allowed:
            what = field[:-1]
            raise DescriptorError(
                field, f"family {t.family} has no {what} '{name}'", " | ".join(allowed) or "none", name
            )
        if isinstance(slot, QuantType):
            raise DescriptorError(field, f"{field[:-1]} '{name}' must be a dense tensor", "a dense type", slot.family)
    if exact and names and sorted(names) != sorted(allowed):
        raise DescriptorError(
            field, f"family {t.family} needs all of its {field}", ", ".join(allowed), ", ".join(names)
        )


def _check_perm(t: QuantType) -> None:
    p = t.perm
    if p is None:
        return
    axis = t.group.axis if t.group is not None else t.rank - 1
    if p.rank != 1 or p.shape[0] != t.shape[axis]:
        raise DescriptorError(
            "perm",
            "permutation must be rank 1 and as long as the group axis",
            f"[{t.shape[axis]}]",
            format_shape(p.shape),
        )
    if not p.dtype.is_integer:
        raise DescriptorError("perm", "permutation must be integer", "i32 | i64", p.dtype)


def _check_pack(t: QuantType) -> None:
    p = t.pack
    layout = find_layout(p.family, p.version)
    if layout is None:
        raise DescriptorError("pack", "unknown layout", "a registered (family, version)", f"{p.family} v{p.version}")
    if p.encoding not in layout.encodings:
        raise DescriptorError(
            "pack",
            f"layout {p.family} v{p.version} has no encoding '{p.encoding}'",
            " | ".join(layout.encodings),
            p.encoding,
        )
    if len(p.tile) != t.rank or any(x < 1 for x in p.tile):
        tile = "[" + ",".join(str(x) for x in p.tile) + "]"
        raise DescriptorError("pack", "tile must have one positive entry per dim", f"{t.rank} entries >= 1", tile)
    padded = padded_shape(t)
    for d, tile in zip(padded, p.tile, strict=True):
        if not is_dynamic(d) and int(d) % tile != 0:
            tile_s = "x".join(str(x) for x in p.tile)
            raise DescriptorError(
                "pack",
                f"tile {tile_s} does not divide the padded shape",
                f"multiples of {tile_s}",
                format_shape(padded),
            )


def _check_words(t: QuantType) -> None:
    if t.req not in QPARAM_USES:
        raise DescriptorError("req", "unknown operator requirement", " | ".join(QPARAM_USES), t.req)
    if t.code.unit not in SELECTION_UNITS:
        raise DescriptorError("unit", "unknown selection unit", " | ".join(SELECTION_UNITS), t.code.unit)
    r = t.rate
    if r is None:
        return
    if r.bits < 0 or r.per < 1:
        raise DescriptorError(
            "rate", "rate needs bits >= 0 per a positive count", "bits >= 0, per >= 1", f"bits={r.bits}, per={r.per}"
        )
    if r.unit not in RATE_UNITS:
        raise DescriptorError("rate", "unknown rate unit", " | ".join(RATE_UNITS), r.unit)
    if r.scope not in RATE_SCOPES:
        raise DescriptorError("rate", "unknown rate scope", " | ".join(RATE_SCOPES), r.scope)
    parts = {"codes", *t.slots(), *(["exceptions"] if t.exceptions else [])}
    for part in r.incl:
        if part not in parts:
            raise DescriptorError(
                "rate", "rate counts a part the descriptor does not have", " | ".join(sorted(parts)), part
            )
    counted = [n for p in r.incl for n in (dict(t.exceptions) if p == "exceptions" else [p])]
    if len(set(counted)) != len(counted):
        raise DescriptorError("rate", "rate counts a part twice", "each part once", ", ".join(r.incl))


# --------------------------------------------------------------------------- rate claims


def dynamic_part(t: DenseType | QuantType, name: str = "") -> str | None:
    """The first part of ``t`` with a dynamic dim (``qparam 'scale' f16[64,?]``), or ``None``."""
    if isinstance(t, DenseType):
        return None if t.is_static else f"{name} {t.short()}".strip()
    if not t.expressed.is_static:
        return f"{name} {t.expressed.short()}".strip()
    for slot, s in t.slots().items():
        if (found := dynamic_part(s, f"{name} {slot}".strip())) is not None:
            return found
    return None


def count(dims: tuple[Dim, ...]) -> int:
    return prod(int(d) for d in dims)


def slot_bits(s: DenseType | QuantType) -> int:
    """Bits a slot stores: a dense one its dtype's width per element; a quantized (nested) one its
    codes and every slot of its own."""
    if isinstance(s, DenseType):
        return count(s.shape) * s.dtype.itemsize * 8
    return part_bits(s, "codes") + sum(slot_bits(x) for x in s.slots().values())


def part_bits(t: QuantType, part: str) -> int:
    """Bits one rate part of a static descriptor stores: ``codes`` (one code of the code type's width
    per element), a slot by name, or ``exceptions`` (every exception slot)."""
    if part == "codes":
        family = Family.registry.get(t.family)
        declared = None if family is None else family.code_bits(t)
        return count(t.shape) * t.code.dtype.bits if declared is None else declared
    if part == "exceptions":
        return sum(slot_bits(s) for _, s in t.exceptions)
    return slot_bits(t.slots()[part])


def rate_units(t: QuantType, unit: str) -> int:
    """How many ``unit``s a static descriptor holds: weights (elements), rows (all dims but the last),
    or blocks (qparam groups; one when per-tensor)."""
    if unit == "row":
        return count(t.shape[:-1])
    if unit == "block":
        return count(expected_qparam_shape(t))
    return count(t.shape)


def rate_claim(t: QuantType, incl: tuple[str, ...], unit: str = "weight", scope: str = "tensor") -> RateClaim:
    """The true rate of static descriptor ``t`` counting ``incl``, over the whole tensor: every bit
    of those parts per every ``unit`` (what a descriptor's writer states, and the verifier recomputes)."""
    return RateClaim(sum(part_bits(t, p) for p in incl), rate_units(t, unit), unit, scope, incl)


def _check_rate(t: QuantType) -> None:
    r = t.rate
    if r is None:
        return
    if (dynamic := dynamic_part(t)) is not None:
        raise DescriptorError("rate", "a rate claim needs static shapes to be checked", "static dims", dynamic)
    if r.scope == "artifact":
        raise DescriptorError(
            "rate", "an artifact-wide rate is not a property of one tensor", "tensor | group | block", r.scope
        )
    want = rate_claim(t, r.incl, r.unit, r.scope)
    if r.scope == "tensor":
        ok, expected = (r.bits, r.per) == (want.bits, want.per), f"bits={want.bits}, per={want.per}"
    else:
        ok, expected = r.bits * want.per == want.bits * r.per, f"bits/per = {want.bits}/{want.per}"
    if not ok:
        raise DescriptorError(
            "rate", "rate claim does not follow from the descriptor", expected, f"bits={r.bits}, per={r.per}"
        )

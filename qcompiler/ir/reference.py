"""Reference decoders: slow, explicit, numpy-only. The oracle every other decode is checked against.

``decode(t, parts)`` turns the parts of a quantized tensor of type ``t`` into its dense values.
``parts`` maps ``"codes"`` (the logical layout: one code per ``int8``/``uint8`` element, logical
shape) and every slot of ``t.slots()`` (qparams, exceptions, transforms, ``perm``) to a numpy array.
A quantized (nested) qparam slot maps to a dict of *its* parts, decoded recursively. Dtypes are the
IR's in-memory containers (``qcompiler.ir.dtypes``): ``bf16`` tensors are raw ``uint16`` bits.

Decoders are registered per ``(family, decoder version)`` in ``DECODERS`` with ``@decoder``::

    @decoder("affine", 1)
    def _affine_v1(t: QuantType, parts: Bound) -> F32Array: ...

Each returns float32 values in the logical layout; ``decode`` casts them to the expressed dtype:
``f32`` as is, ``f16`` rounded to float16 (a ``float16`` array), ``bf16`` rounded to bfloat16 but
returned as a ``float32`` array (numpy has no bfloat16; every value is bf16-representable), ``f64``
widened exactly. Grouping: groups of ``size`` along ``axis`` share one qparam entry (a short last
group under ``tail=partial`` or ``tail=pad`` alike; codes always have the logical shape); without a
group spec one qparam entry (shape all ones, or a scalar) covers the whole tensor.

Act-order ``perm`` (along the group axis; the last axis when per-tensor): stored position ``j`` holds
original position ``perm[j]``. Groups are formed in stored order, then written to ``perm[j]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from qcompiler.errors import QcError
from qcompiler.ir.descriptor import DescriptorError, check_descriptor
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.group_chunks import affine_whole_groups, group_chunks
from qcompiler.ir.minifloat import E4M3FN, round_to_bf16
from qcompiler.ir.types import DenseType, QuantType, dims_match, format_shape

Array: TypeAlias = npt.NDArray[Any]
F32Array: TypeAlias = npt.NDArray[np.float32]
Parts: TypeAlias = "Mapping[str, Array | Parts]"
"""``{"codes": array, slot name: array, nested slot name: Parts}``."""


class DecodeError(QcError):
    """The parts do not fit the descriptor, or no reference decoder knows its family and version."""

    def __init__(self, part: str, message: str, expected: object = "", found: object = "") -> None:
        self.part = part
        self.message = message
        text = f"{part}: {message}" if part else message
        if expected != "" or found != "":
            text += f" (expected {expected}, found {found})"
        super().__init__(text)


@dataclass(frozen=True)
class Bound:
    """Parts checked against a descriptor: integer ``codes`` and every slot as float64/int64 values.

    Float slots hold the exact values of the stored floats; qparams have the group layout (per-tensor
    qparams are reshaped to all ones); a nested qparam holds its decoded values.
    """

    shape: tuple[int, ...]
    codes: npt.NDArray[np.integer[Any]]
    slots: dict[str, Array]


Decoder: TypeAlias = Callable[[QuantType, Bound], F32Array]

DECODERS: dict[tuple[str, int], Decoder] = {}
"""Reference decoder per ``(family, decoder version)``."""


def decoder(family: str, version: int) -> Callable[[Decoder], Decoder]:
    """Register a reference decoder for ``(family, version)``."""

    def register(fn: Decoder) -> Decoder:
        if (family, version) in DECODERS:
            raise TypeError(f"reference decoder {family} v{version} registered twice")
        DECODERS[family, version] = fn
        return fn

    return register


def decode(t: QuantType, parts: Parts) -> Array:
    """Decode ``parts`` of a tensor of type ``t`` to its expressed dtype (see the module docstring)."""
    return _decode(t, parts, "")


def _decode(t: QuantType, parts: Parts, where: str) -> Array:
    fn = DECODERS.get((t.family, t.decoder))
    if fn is None:
        known = ", ".join(f"{f} v{v}" for f, v in sorted(DECODERS))
        raise DecodeError(
            where + "decoder", "no reference decoder for this family and version", known, f"{t.family} v{t.decoder}"
        )
    bound = _bind(t, parts, where)
    return _to_expressed(fn(t, bound), t.expressed.dtype.name, where)


# ---------------------------------------------------------------------------------------------
# Binding: check every part against the descriptor, then hold exact values.


def _bind(t: QuantType, parts: Parts, where: str) -> Bound:
    try:
        check_descriptor(t)
    except DescriptorError as e:
        raise DecodeError(f"{where}descriptor: {e.field}", e.message, e.expected, e.found) from None
    if (t.pack.family, t.pack.version) != ("logical", 1) or t.code.unit != "element" or t.code.rev != 1:
        raise DecodeError(
            where + "descriptor",
            "reference decoders read the logical layout of element codes",
            "pack logical v1, unit=element, rev=1",
            f"pack {t.pack.family} v{t.pack.version}, unit={t.code.unit}, rev={t.code.rev}",
        )
    slots = t.slots()
    want = {"codes", *slots}
    missing, unknown = sorted(want - set(parts)), sorted(set(parts) - want)
    if missing:
        raise DecodeError(where + missing[0], "missing part", ", ".join(sorted(want)), ", ".join(sorted(parts)))
    if unknown:
        raise DecodeError(where + unknown[0], "unknown part for this descriptor", ", ".join(sorted(want)), unknown[0])
    codes = _bind_codes(t, parts["codes"], where)
    shape = tuple(int(d) for d in codes.shape)
    qshape = _qparam_shape(t, shape)
    bound: dict[str, Array] = {}
    for name, slot in t.qparams:
        bound[name] = _bind_qparam(name, slot, parts[name], qshape, where)
    for name, slot in (*t.exceptions, *t.transforms):
        if isinstance(slot, QuantType):
            raise DecodeError(where + name, "exception and transform slots must be dense", "a dense type", slot.family)
        bound[name] = _bind_dense(where + name, slot, _array(where + name, parts[name]))
    if t.perm is not None:
        bound["perm"] = _bind_perm(t.perm, parts["perm"], shape[_perm_axis(t)], where)
    return Bound(shape, codes, bound)


def _array(part: str, value: Array | Parts) -> Array:
    if not isinstance(value, np.ndarray):
        raise DecodeError(part, "part must be a numpy array", "numpy.ndarray", type(value).__name__)
    return value


def _bind_codes(t: QuantType, value: Array | Parts, where: str) -> npt.NDArray[np.integer[Any]]:
    """The codes, checked against dtype, shape and alphabet, in their integer container (every
    decoder widens them to float itself)."""
    part = where + "codes"
    codes = _array(part, value)
    container = t.code.dtype.container.numpy
    if codes.dtype != np.dtype(container):
        raise DecodeError(part, "wrong dtype", container, codes.dtype)
    if codes.ndim != t.rank or not all(dims_match(d, w) for d, w in zip(codes.shape, t.shape, strict=True)):
        raise DecodeError(part, "wrong shape", format_shape(t.shape), format_shape(codes.shape))
    alphabet = t.code.alphabet
    if alphabet.values is None and (codes.size == 0 or (codes.min() >= alphabet.lo and codes.max() <= alphabet.hi)):
        return codes  # a range alphabet: two reductions prove every code inside
    allowed = set(alphabet.values) if alphabet.values is not None else set(range(alphabet.lo, alphabet.hi + 1))
    outside = np.argwhere(~np.isin(codes, sorted(allowed)))
    if outside.shape[0] > 0:
        index = tuple(int(i) for i in outside[0])  # the first bad code in row-major order
        at = ",".join(str(i) for i in index)
        raise DecodeError(f"{part}[{at}]", "code outside the alphabet", alphabet, int(codes[index]))
    return codes


def _qparam_shape(t: QuantType, shape: tuple[int, ...]) -> tuple[int, ...]:
    if t.group is None:
        return tuple(1 for _ in shape)
    groups = -(-shape[t.group.axis] // t.group.size)
    return tuple(groups if i == t.group.axis else d for i, d in enumerate(shape))


def _bind_qparam(
    name: str, slot: DenseType | QuantType, value: Array | Parts, qshape: tuple[int, ...], where: str
) -> Array:
    part = where + name
    if isinstance(slot, QuantType):
        if isinstance(value, np.ndarray):
            raise DecodeError(part, "a quantized qparam needs a dict of its parts", "dict", "numpy.ndarray")
        values = _decode(slot, value, part + ".").astype(np.float64)
    else:
        values = _bind_dense(part, slot, _array(part, value))
    if values.shape != qshape and not (values.size == 1 and all(d == 1 for d in qshape)):
        raise DecodeError(
            part, "qparam shape does not fit the codes and the group", format_shape(qshape), format_shape(values.shape)
        )
    return values.reshape(qshape)


def _bind_dense(part: str, slot: DenseType, arr: Array) -> Array:
    """Exact values of a dense slot: float64 for floats (bf16 bits widened), int64 for integers."""
    container = DTYPES[slot.dtype.name].numpy
    if arr.dtype != np.dtype(container):
        raise DecodeError(part, f"wrong dtype for {slot.dtype.name}", container, arr.dtype)
    if arr.ndim != slot.rank or not all(dims_match(d, w) for d, w in zip(arr.shape, slot.shape, strict=True)):
        raise DecodeError(part, "wrong shape", format_shape(slot.shape), format_shape(arr.shape))
    name = slot.dtype.name
    if name == "bf16":
        return (arr.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if name in ("f64", "f32", "f16"):
        return arr.astype(np.float64)
    if slot.dtype.is_integer:
        return arr.astype(np.int64)
    raise DecodeError(part, "the reference decoders do not read this dtype", "f64 | f32 | f16 | bf16 | integer", name)


def _perm_axis(t: QuantType) -> int:
    return t.group.axis if t.group is not None else t.rank - 1


def _bind_perm(slot: DenseType, value: Array | Parts, length: int, where: str) -> Array:
    part = where + "perm"
    perm = _bind_dense(part, slot, _array(part, value))
    if perm.shape != (length,) or sorted(int(p) for p in perm) != list(range(length)):
        raise DecodeError(
            part, "not a permutation of the group axis", f"a permutation of 0..{length - 1}", [int(p) for p in perm]
        )
    return perm


# ---------------------------------------------------------------------------------------------
# Shared pieces: groups, permutation, expressed dtype.


def _groups(t: QuantType, shape: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], tuple[slice, ...]]]:
    """Each group as (its qparam index, the slice of stored codes it covers), in stored order."""
    if t.group is None:
        yield tuple(0 for _ in shape), tuple(slice(0, d) for d in shape)
        return
    axis, size = t.group.axis, t.group.size
    for qi in np.ndindex(_qparam_shape(t, shape)):
        start = qi[axis] * size
        stop = min(start + size, shape[axis])  # a short last group keeps its real length
        yield qi, tuple(slice(start, stop) if d == axis else slice(i, i + 1) for d, i in enumerate(qi))


def _unpermute(t: QuantType, stored: F32Array, perm: Array | None) -> F32Array:
    """Write stored position ``j`` along the perm axis to output position ``perm[j]``."""
    if perm is None:
        return stored
    axis = _perm_axis(t)
    out = np.empty_like(stored)
    for j in range(stored.shape[axis]):
        src = tuple(j if d == axis else slice(None) for d in range(stored.ndim))
        dst = tuple(int(perm[j]) if d == axis else slice(None) for d in range(stored.ndim))
        out[dst] = stored[src]
    return out


def _to_expressed(x: F32Array, dtype: str, where: str) -> Array:
    if dtype == "f32":
        return x
    if dtype == "f16":
        with np.errstate(over="ignore"):  # overflow to inf is the IEEE cast, on purpose
            return x.astype(np.float16)
    if dtype == "f64":
        return x.astype(np.float64)
    if dtype == "bf16":
        return round_to_bf16(x)
    raise DecodeError(
        where + "expressed", "the reference decoders do not produce this dtype", "f32 | f16 | bf16 | f64", dtype
    )


def _affine_values(codes: npt.NDArray[np.integer[Any]], zero: float, scale: float) -> F32Array:
    """``float32(code - zero) * float32(scale)``, computed in float64 then rounded once to float32.

    ``code - zero`` is a float32 (exact for integer zero points: |code - zero| < 2**24); ``scale``
    is a float32. A product of two float32 numbers needs at most 48 significant bits, so it is
    exact in float64, and rounding that exact product to float32 is precisely the one correctly
    rounded float32 multiply of the contract (including overflow to inf and subnormal results).
    """
    diff = (codes.astype(np.float64) - float(zero)).astype(np.float32)
    scale32 = float(np.float32(scale))
    return (diff.astype(np.float64) * scale32).astype(np.float32)


def _affine_grouped(t: QuantType, b: Bound) -> F32Array:
    """Affine decode of every group (``zero = 0`` when there is no ``zero`` slot), then ``perm``."""
    scale, zero = b.slots["scale"], b.slots.get("zero")
    if t.group is not None:
        return _unpermute(t, _affine_broadcast(t, b, scale, zero), b.slots.get("perm"))
    stored = np.zeros(b.shape, dtype=np.float32)
    for qi, sl in _groups(t, b.shape):
        z = 0.0 if zero is None else float(zero[qi])
        stored[sl] = _affine_values(b.codes[sl], z, float(scale[qi]))
    return _unpermute(t, stored, b.slots.get("perm"))


def _affine_broadcast(t: QuantType, b: Bound, scale: Array, zero: Array | None) -> F32Array:
    """``_affine_values`` of every group at once: the same float64 difference rounded once to float32
    (exact int32 arithmetic for integer zero points), then the float32 product (a float32 multiply
    is correctly rounded, as the float64 product rounded once is)."""
    assert t.group is not None
    whole = affine_whole_groups(b.codes, scale, zero, t.group.axis, t.group.size)
    if whole is not None:
        return whole
    out = np.empty(b.shape, dtype=np.float32)
    integral = zero is None or np.issubdtype(zero.dtype, np.integer)
    for idx, expand in group_chunks(t.group.axis, t.group.size, b.shape, scale):
        sc = expand(scale).astype(np.float32)
        if integral:  # integer code - integer zero is exact in int32 and in float32 (|diff| < 2**24)
            c = b.codes[idx].astype(np.int32)
            diff = (c if zero is None else c - expand(zero).astype(np.int32)).astype(np.float32)
        else:
            assert zero is not None
            diff = (b.codes[idx].astype(np.float64) - expand(zero)).astype(np.float32)
        np.multiply(diff, sc, out=out[idx])
    return out


# ---------------------------------------------------------------------------------------------
# The decoders.


@decoder("affine", 1)
def _affine_v1(t: QuantType, b: Bound) -> F32Array:
    """``x = float32(code - zero[g]) * float32(scale[g])``; ``zero`` absent means 0."""
    if "rotation" in b.slots:
        raise DecodeError(
            "rotation", "affine v1 defines no decode for a rotation transform", "no transforms", "rotation"
        )
    return _affine_grouped(t, b)


@decoder("ternary", 1)
def _ternary_v1(t: QuantType, b: Bound) -> F32Array:
    """``x = float32(code) * float32(scale[g])`` with codes in {-1, 0, 1}."""
    return _affine_grouped(t, b)


@decoder("f8e4m3", 1)
def _f8e4m3_v1(t: QuantType, b: Bound) -> F32Array:
    """``x = float32(e4m3fn(code)) * float32(scale[g])`` (``minifloat.E4M3FN``), one float32 multiply."""
    values, scale = E4M3FN[b.codes.astype(np.intp)], b.slots["scale"]
    if t.group is None:
        out = np.multiply(values, np.float32(scale.reshape(-1)[0]), dtype=np.float32)
        return _unpermute(t, out, b.slots.get("perm"))
    out = np.empty(b.shape, dtype=np.float32)
    for idx, expand in group_chunks(t.group.axis, t.group.size, b.shape, scale):
        np.multiply(values[idx], expand(scale).astype(np.float32), out=out[idx])
    return _unpermute(t, out, b.slots.get("perm"))


@decoder("nested", 1)
def _nested_v1(t: QuantType, b: Bound) -> F32Array:
    """``x = float32(float32(scale[g]) * float32(code)) - float32(min[g])``, float32 ops in that order.

    ``scale`` and ``min`` were decoded already when they are quantized (K-quant super-blocks).
    """
    scale, low = b.slots["scale"], b.slots.get("min")
    if t.group is not None:
        out = np.empty(b.shape, dtype=np.float32)
        for idx, expand in group_chunks(t.group.axis, t.group.size, b.shape, scale):
            values = np.multiply(expand(scale).astype(np.float32), b.codes[idx].astype(np.float32), dtype=np.float32)
            if low is not None:
                values = np.subtract(values, expand(low).astype(np.float32), dtype=np.float32)
            out[idx] = values
        return _unpermute(t, out, b.slots.get("perm"))
    stored = np.zeros(b.shape, dtype=np.float32)
    for qi, sl in _groups(t, b.shape):
        codes32 = b.codes[sl].astype(np.float32)
        scale32 = np.full(codes32.shape, scale[qi], dtype=np.float32)
        values = np.multiply(scale32, codes32, dtype=np.float32)
        if low is not None:
            values = np.subtract(values, np.full(codes32.shape, low[qi], dtype=np.float32), dtype=np.float32)
        stored[sl] = values
    return _unpermute(t, stored, b.slots.get("perm"))


@decoder("mixed", 1)
def _mixed_v1(t: QuantType, b: Bound) -> F32Array:
    """Affine decode, then ``out.flat[index[i]] = float32(value[i])`` (row-major flat index of the
    decoded, un-permuted tensor). The cast to the expressed dtype comes after, for every element."""
    out = _affine_grouped(t, b).copy()
    index, value = b.slots["index"], b.slots["value"]
    if value.shape != index.shape:
        raise DecodeError(
            "value", "one exception value per index", format_shape(index.shape), format_shape(value.shape)
        )
    flat = out.reshape(-1)
    previous = -1
    for i in range(index.shape[0]):
        at = int(index[i])
        if not 0 <= at < flat.shape[0]:
            raise DecodeError(f"index[{i}]", "exception index outside the tensor", f"in [0, {flat.shape[0] - 1}]", at)
        if at <= previous:
            raise DecodeError(f"index[{i}]", "exception indices must be strictly increasing", f"> {previous}", at)
        flat[at] = np.float32(value[i])
        previous = at
    return flat.reshape(b.shape)

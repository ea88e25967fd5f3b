"""ggml's 32-element block codecs: Q8_0 and the 4/5-bit Q4_0, Q4_1, Q5_0, Q5_1 (see ``codecs``)."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from qcompiler.backends.gguf.codecs import (
    F32,
    Array,
    Codec,
    Part,
    Parts,
    f16_bytes,
    f16_of,
    pack_high_bits,
    pack_nibbles,
    recip,
    roundf,
    unpack_high_bits,
    unpack_nibbles,
)
from qcompiler.backends.gguf.ggml_types import GGMLType


class Q8_0(Codec, type=GGMLType.Q8_0):
    """8-bit symmetric, ``x = q * d``; quantize: ``d = amax/127``, ``q = roundf(x * (1/d))``.

    | bytes | field | part |
    |---|---|---|
    | 0-1 | ``d`` f16 | ``scale`` (one per 32) |
    | 2-33 | ``qs`` int8[32] | ``codes`` |
    """

    layout = (("d", 2), ("qs", 32))
    code_fields = ("qs",)
    parts = (Part("codes", "int8", 1, -128, 127), Part("scale", "float16", 32))

    @classmethod
    def _encode(cls, x: Array) -> Parts:
        d = np.abs(x).max(axis=1, keepdims=True) / F32(127)
        return {"codes": roundf(x * recip(d)).astype(np.int8), "scale": d.astype(np.float16)}

    @classmethod
    def pack_codes(cls, u: Array) -> Parts:
        """Stored code bytes ``(blocks, 32)`` (two's complement) -> the code fields."""
        return {"qs": u}

    @classmethod
    def unpack_codes(cls, f: Parts) -> Array:
        """The inverse of ``pack_codes``."""
        return f["qs"]

    @classmethod
    def _param_fields(cls, p: Parts) -> Parts:
        return {"d": f16_bytes(p["scale"])}

    @classmethod
    def _params(cls, f: Parts) -> Parts:
        return {"scale": f16_of(f["d"])}

    @classmethod
    def _pack(cls, p: Parts) -> Array:
        return cls._assemble(cls._param_fields(p) | cls.pack_codes(p["codes"].view(np.uint8)))

    @classmethod
    def _unpack(cls, b: Array) -> Parts:
        f = cls._fields(b)
        return {"codes": cls.unpack_codes(f).view(np.int8)} | cls._params(f)

    @classmethod
    def _decode(cls, p: Parts) -> Array:
        return p["codes"].astype(F32) * p["scale"].astype(F32)


class LowBit(Codec):
    """Q4_0, Q4_1, Q5_0, Q5_1: 32 elements of ``bits``-bit codes, symmetric (``_0``) or with a min (``_1``).

    | type | bytes | fields in order | part ``codes`` | other parts (one per 32) |
    |---|---|---|---|---|
    | Q4_0 | 18 | ``d`` f16, ``qs`` [16] | int8 -8..7 | ``scale`` |
    | Q4_1 | 20 | ``d``, ``m`` f16, ``qs`` [16] | uint8 0..15 | ``scale``, ``min`` |
    | Q5_0 | 22 | ``d``, ``qh`` [4], ``qs`` [16] | int8 -16..15 | ``scale`` |
    | Q5_1 | 24 | ``d``, ``m``, ``qh`` [4], ``qs`` [16] | uint8 0..31 | ``scale``, ``min`` |

    ``qs`` byte ``j``: low nibble = element ``j``, high nibble = element ``j + 16``; ``qh`` (u32 LE) bit
    ``j`` = bit 4 of element ``j``. Symmetric, with ``h = 2^(bits-1)``: ``max`` = the signed value of
    largest ``|x|`` (first wins, +0 if all zero), ``d = max / -h``, ``q = min(2h-1, (int)(x*id + h + 0.5))``,
    ``codes = q - h``, ``x = codes * d``. With min: ``d = (max - min) / (2^bits - 1)``, ``q = min(2^bits - 1,
    (int)((x - min)*id + 0.5))``, ``x = q*d + min``; min/max are first occurrences (the sign of a zero min).
    """

    bits: ClassVar[int]

    @classmethod
    def _encode(cls, x: Array) -> Parts:
        top = (1 << cls.bits) - 1
        if cls.parts[0].dtype == "int8":
            half = 1 << (cls.bits - 1)
            m = np.take_along_axis(x, np.abs(x).argmax(axis=1, keepdims=True), axis=1)
            d = np.where(m == 0, F32(0), m) / F32(-half)
            q = np.minimum(np.trunc(x * recip(d) + F32(half + 0.5)), F32(top))
            return {"codes": (q - half).astype(np.int8), "scale": d.astype(np.float16)}
        lo = np.take_along_axis(x, x.argmin(axis=1, keepdims=True), axis=1)
        hi = np.take_along_axis(x, x.argmax(axis=1, keepdims=True), axis=1)
        d = (hi - lo) / F32(top)
        q = np.minimum(np.trunc((x - lo) * recip(d) + F32(0.5)), F32(top))
        return {"codes": q.astype(np.uint8), "scale": d.astype(np.float16), "min": lo.astype(np.float16)}

    @classmethod
    def pack_codes(cls, u: Array) -> Parts:
        """Stored values ``u = codes - lo`` ``(blocks, 32)``, uint8 -> the code fields ``qs`` (and ``qh``)."""
        return {"qs": pack_nibbles(u, 32)} | ({"qh": pack_high_bits(u)} if cls.bits == 5 else {})

    @classmethod
    def unpack_codes(cls, f: Parts) -> Array:
        """The inverse of ``pack_codes``: the code fields -> stored values ``(blocks, 32)``, uint8."""
        u = unpack_nibbles(f["qs"], 32)
        return u | unpack_high_bits(f["qh"]) if cls.bits == 5 else u

    @classmethod
    def _param_fields(cls, p: Parts) -> Parts:
        return {"d": f16_bytes(p["scale"])} | ({"m": f16_bytes(p["min"])} if "min" in p else {})

    @classmethod
    def _params(cls, f: Parts) -> Parts:
        return {"scale": f16_of(f["d"])} | ({"min": f16_of(f["m"])} if "m" in f else {})

    @classmethod
    def _pack(cls, p: Parts) -> Array:
        q = (p["codes"].astype(np.int16) - (cls.parts[0].lo or 0)).astype(np.uint8)
        return cls._assemble(cls._param_fields(p) | cls.pack_codes(q))

    @classmethod
    def _unpack(cls, b: Array) -> Parts:
        f = cls._fields(b)
        q = cls.unpack_codes(f)
        codes = (q.astype(np.int16) + (cls.parts[0].lo or 0)).astype(cls.parts[0].dtype)
        return {"codes": codes} | cls._params(f)

    @classmethod
    def _decode(cls, p: Parts) -> Array:
        y = p["codes"].astype(F32) * p["scale"].astype(F32)
        return y + p["min"].astype(F32) if "min" in p else y


class Q4_0(LowBit, type=GGMLType.Q4_0):
    bits = 4
    layout = (("d", 2), ("qs", 16))
    code_fields = ("qs",)
    parts = (Part("codes", "int8", 1, -8, 7), Part("scale", "float16", 32))


class Q4_1(LowBit, type=GGMLType.Q4_1):
    bits = 4
    layout = (("d", 2), ("m", 2), ("qs", 16))
    code_fields = ("qs",)
    parts = (Part("codes", "uint8", 1, 0, 15), Part("scale", "float16", 32), Part("min", "float16", 32))


class Q5_0(LowBit, type=GGMLType.Q5_0):
    bits = 5
    layout = (("d", 2), ("qh", 4), ("qs", 16))
    code_fields = ("qh", "qs")
    parts = (Part("codes", "int8", 1, -16, 15), Part("scale", "float16", 32))


class Q5_1(LowBit, type=GGMLType.Q5_1):
    bits = 5
    layout = (("d", 2), ("m", 2), ("qh", 4), ("qs", 16))
    code_fields = ("qh", "qs")
    parts = (Part("codes", "uint8", 1, 0, 31), Part("scale", "float16", 32), Part("min", "float16", 32))

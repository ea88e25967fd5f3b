"""The codecs of ggml's plain types, one element per block: F32, F16 and BF16 (see ``codecs``)."""

from __future__ import annotations

import numpy as np

from qcompiler.backends.gguf.codecs import F32, Array, Codec, Part, Parts
from qcompiler.backends.gguf.ggml_types import GGMLType


class Plain(Codec):
    """F32, F16 and BF16: one value per block, little-endian, part ``values``."""

    finite_only = False
    views = True

    @classmethod
    def _encode(cls, x: Array) -> Parts:
        return {"values": x.astype(cls.parts[0].dtype)}

    @classmethod
    def _pack(cls, p: Parts) -> Array:
        return np.ascontiguousarray(p["values"]).view(np.uint8)

    @classmethod
    def _unpack(cls, b: Array) -> Parts:
        return {"values": b.view(cls.parts[0].dtype)}

    @classmethod
    def _decode(cls, p: Parts) -> Array:
        return p["values"].astype(F32)


class F32Codec(Plain, type=GGMLType.F32):
    """float32 (4 bytes)."""

    layout = (("value", 4),)
    parts = (Part("values", "float32", 1),)


class F16Codec(Plain, type=GGMLType.F16):
    """float16 (2 bytes): round to nearest even, overflow to inf."""

    layout = (("value", 2),)
    parts = (Part("values", "float16", 1),)


class BF16Codec(Plain, type=GGMLType.BF16):
    """bfloat16 (2 bytes), the high half of a float32; part ``values`` holds its bits as uint16.

    Encoding is ggml's ``ggml_compute_fp32_to_bf16``: a NaN keeps its high half with the quiet bit
    (0x40) set; everything else rounds to nearest even (overflowing to inf)."""

    layout = (("value", 2),)
    parts = (Part("values", "uint16", 1),)

    @classmethod
    def _encode(cls, x: Array) -> Parts:
        u = x.view(np.uint32)
        nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        rne = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
        return {"values": np.where(nan, (u >> 16) | np.uint32(0x40), rne).astype(np.uint16)}

    @classmethod
    def _decode(cls, p: Parts) -> Array:
        return (p["values"].astype(np.uint32) << 16).view(F32)

"""Codecs of the 256-element (``QK_K``) super-block types: TQ1_0 and TQ2_0 (ternary) and the K-quants
Q4_K, Q5_K, Q6_K, whose reference quantizer (an iterative search per sub-block) is in ``kquant``.

K-quants are hierarchical: each 256-element super-block has float16 ``d`` (and ``dmin``), and each
sub-block an integer sub-scale (and sub-min) quantized against them, so ``split`` gives nested qparams::

    >>> import numpy as np
    >>> from qcompiler.backends.gguf.codecs import get_codec
    >>> from qcompiler.backends.gguf.ggml_types import GGMLType
    >>> parts = get_codec(GGMLType.Q4_K).split(np.zeros((2, 144), dtype=np.uint8))  # 2 rows x 1 block
    >>> {name: a.shape for name, a in parts.items()}
    {'codes': (2, 256), 'sub_scale': (2, 8), 'sub_min': (2, 8), 'd': (2, 1), 'dmin': (2, 1)}
"""

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
    pack_nibbles,
    recip,
    roundf,
    unpack_nibbles,
)
from qcompiler.backends.gguf.ggml_types import GGMLType
from qcompiler.backends.gguf.kquant import encode_q6_k, encode_qkx


def pack_fields(fields: Array, width: int) -> Array:
    """``(..., k, L)`` fields of ``width`` bits -> ``(..., L)`` bytes; field ``i`` at bit ``width*i``."""
    shifts = (np.arange(fields.shape[-2], dtype=np.uint8) * np.uint8(width))[:, None]
    return np.bitwise_or.reduce(fields.astype(np.uint8) << shifts, axis=-2)


def unpack_fields(packed: Array, width: int, count: int) -> Array:
    """The inverse of ``pack_fields``: ``(..., L)`` bytes -> ``(..., count, L)`` fields."""
    shifts = (np.arange(count, dtype=np.uint8) * np.uint8(width))[:, None]
    return (packed[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)[:, None]
"""TQ1_0 decoding: ``(b * 3^i) mod 256`` brings trit ``i`` of byte ``b`` to the top."""
DIGITS = np.array([81, 27, 9, 3, 1], dtype=np.uint16)[:, None]
"""TQ1_0 encoding: trit ``i`` of a byte weighs ``3^(4-i)`` (the first trit is the most significant)."""


class Ternary(Codec):
    """TQ1_0 and TQ2_0: trits ``q`` in {0, 1, 2} (part ``codes`` = ``q - 1``) and one f16 ``d`` per 256.

    Quantize: ``d = amax`` (the largest ``|x|`` itself), ``q = lroundf(x * (1/d)) + 1``; ``x = (q - 1) * d``.
    """

    @classmethod
    def _encode(cls, x: Array) -> Parts:
        d = np.abs(x).max(axis=1, keepdims=True)
        return {"codes": roundf(x * recip(d)).astype(np.int8), "scale": d.astype(np.float16)}

    @classmethod
    def _decode(cls, p: Parts) -> Array:
        return p["codes"].astype(F32) * p["scale"].astype(F32)

    @classmethod
    def _param_fields(cls, p: Parts) -> Parts:
        return {"d": f16_bytes(p["scale"])}

    @classmethod
    def _params(cls, f: Parts) -> Parts:
        return {"scale": f16_of(f["d"])}


def canonical_bytes(trits: int) -> Array:
    """TQ1_0: each byte value -> the byte ``join`` writes for the first ``trits`` trits it decodes to
    (``ceil(v * 256 / 243)``; 5 trits in ``qs``, 4 in ``qh``): ``join(split(b))`` byte by byte."""
    b = np.arange(256, dtype=np.uint8)[None, :]
    t = ((b * POW3[:trits]).astype(np.uint16) * 3) >> 8
    v = (t * DIGITS[:trits]).sum(axis=0)
    return ((v * 256 + 242) // 243).astype(np.uint8)


CANONICAL = {"qs": canonical_bytes(5), "qh": canonical_bytes(4)}
"""TQ1_0's code fields -> their canonical bytes (the identity on bytes ``quantize`` writes)."""


class TQ1_0(Ternary, type=GGMLType.TQ1_0):
    """1.6875 bits per weight: 5 trits per byte (4 in ``qh``), stored as ``ceil(v * 256 / 243)``.

    | bytes | field | elements |
    |---|---|---|
    | 0-31 | ``qs`` | byte ``m``: ``v = sum_i t[32i + m] * 3^(4-i)``, i < 5 (elements 0..159) |
    | 32-47 | ``qs`` | byte ``32 + m``: ``t[160 + 16i + m]``, i < 5 |
    | 48-51 | ``qh`` | byte ``m``: ``v = sum_i t[240 + 4i + m] * 3^(4-i)``, i < 4 |
    | 52-53 | ``d`` | f16 -> part ``scale`` |

    Trit ``i`` of byte ``b`` is ``((b * 3^i) mod 256) * 3 >> 8``. Only 243 of the 256 byte values are
    ``ceil`` images, so ``join(split(b))`` rewrites a non-canonical byte to the canonical one with the
    same trits (and the same dequantized values); blobs from ``quantize`` are canonical.
    """

    layout = (("qs", 48), ("qh", 4), ("d", 2))
    code_fields = ("qs", "qh")
    parts = (Part("codes", "int8", 1, -1, 1), Part("scale", "float16", 256))

    @classmethod
    def _pack(cls, p: Parts) -> Array:
        t = (p["codes"] + np.int8(1)).astype(np.uint16)
        n = t.shape[0]
        groups = [t[:, :160].reshape(n, 5, 32), t[:, 160:240].reshape(n, 5, 16), t[:, 240:].reshape(n, 4, 4)]
        values = np.concatenate([(g * DIGITS[: g.shape[1]]).sum(axis=1) for g in groups], axis=1)
        qs = ((values * 256 + 242) // 243).astype(np.uint8)  # ceil(v * 256 / 243)
        return cls._assemble({"qs": qs[:, :48], "qh": qs[:, 48:]} | cls._param_fields(p))

    @classmethod
    def _unpack(cls, b: Array) -> Parts:
        f, n = cls._fields(b), b.shape[0]

        def trits(raw: Array, k: int) -> Array:
            return (((raw[:, None, :] * POW3[:k]).astype(np.uint16) * 3) >> 8).reshape(n, -1)

        t = np.concatenate([trits(f["qs"][:, :32], 5), trits(f["qs"][:, 32:], 5), trits(f["qh"], 4)], axis=1)
        return {"codes": t.astype(np.int8) - np.int8(1)} | cls._params(f)

    @classmethod
    def canonical_code_bytes(cls, code: Array) -> Array:
        """Each code byte in its canonical form (what ``join`` of its trits writes)."""
        fields = cls.split_code_bytes(np.asarray(code).reshape(-1, cls.code_size()))
        canon = {name: CANONICAL[name][a] for name, a in fields.items()}
        return cls.join_code_fields(canon).reshape(np.shape(code))


class TQ2_0(Ternary, type=GGMLType.TQ2_0):
    """2.0625 bits per weight: 2-bit fields holding ``q`` (3 decodes as ``+2 * d``; quantize never writes it).

    | bytes | field | elements |
    |---|---|---|
    | 0-63 | ``qs`` | byte ``32c + m``, bits ``2i..2i+1``: element ``128c + 32i + m`` -> part ``codes`` (-1..2) |
    | 64-65 | ``d`` | f16 -> part ``scale`` |
    """

    layout = (("qs", 64), ("d", 2))
    code_fields = ("qs",)
    parts = (Part("codes", "int8", 1, -1, 2), Part("scale", "float16", 256))

    @classmethod
    def _pack(cls, p: Parts) -> Array:
        q = (p["codes"] + np.int8(1)).astype(np.uint8).reshape(-1, 2, 4, 32)
        return cls._assemble({"qs": pack_fields(q, 2)} | cls._param_fields(p))

    @classmethod
    def _unpack(cls, b: Array) -> Parts:
        f = cls._fields(b)
        q = unpack_fields(f["qs"].reshape(-1, 2, 32), 2, 4).reshape(b.shape[0], -1)
        return {"codes": q.astype(np.int8) - np.int8(1)} | cls._params(f)


def scale_min_k4(raw: Array) -> tuple[Array, Array]:
    """Q4_K/Q5_K ``scales[12]`` -> 8 six-bit sub-scales and 8 sub-mins (ggml's ``get_scale_min_k4``)."""
    a, b, c = raw[:, 0:4], raw[:, 4:8], raw[:, 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mn


def pack_scale_min_k4(sc: Array, mn: Array) -> Array:
    """The inverse of ``scale_min_k4``."""
    a = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    b = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    return np.concatenate([a, b, (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1).astype(np.uint8)


class KQuant(Codec):
    """Q4_K and Q5_K: 8 sub-blocks of 32, ``x = (d * sub_scale) * q - (dmin * sub_min)``.

    | bytes | field | content |
    |---|---|---|
    | 0-1, 2-3 | ``d``, ``dmin`` | f16 super-block scales of the sub-scales and of the sub-mins |
    | 4-15 | ``scales`` | 6-bit ``sub_scale[j]``, ``sub_min[j]`` (below) |
    | 16-... | ``qh`` (Q5_K only, 32) | bit ``i`` of byte ``l``: bit 4 of element ``32i + l`` |
    | last 128 | ``qs`` | per 64 elements ``c``: byte ``32c + l`` low = element ``64c + l``, high = ``64c + 32 + l`` |

    ``scales``: for j < 4, bits 0-5 of bytes ``j`` and ``j+4``; for j >= 4, the low and high nibble of
    byte ``j+4``, with bits 4-5 in bits 6-7 of bytes ``j-4`` and ``j``.

    Quantize (``kquant.encode_qkx``): per sub-block, ggml's ``make_qkx2_quants`` search (weights
    ``av_x + |x|``) gives a scale and a min; ``d``/``dmin`` = their largest / 63; 6-bit sub-scales and
    sub-mins by ``nearest_int``; then ``q = clamp(nearest_int((x + dmin*sub_min) / (d*sub_scale)), 0, nmax)``.
    """

    search: ClassVar[tuple[int, float, float, int]]
    """``make_qkx2_quants``'s (nmax, rmin, rdelta, nstep)."""

    @classmethod
    def _encode(cls, x: Array) -> Parts:
        return encode_qkx(x, *cls.search)

    @classmethod
    def _param_fields(cls, p: Parts) -> Parts:
        scales = pack_scale_min_k4(p["sub_scale"], p["sub_min"])
        return {"d": f16_bytes(p["d"]), "dmin": f16_bytes(p["dmin"]), "scales": scales}

    @classmethod
    def _params(cls, f: Parts) -> Parts:
        sc, mn = scale_min_k4(f["scales"])
        return {"sub_scale": sc, "sub_min": mn, "d": f16_of(f["d"]), "dmin": f16_of(f["dmin"])}

    @classmethod
    def _pack(cls, p: Parts) -> Array:
        q = p["codes"]
        f = cls._param_fields(p) | {"qs": pack_nibbles(q, 64)}
        if "qh" in dict(cls.layout):
            f["qh"] = pack_fields((q >> 4).reshape(-1, 8, 32), 1)
        return cls._assemble(f)

    @classmethod
    def _unpack(cls, b: Array) -> Parts:
        f = cls._fields(b)
        q = unpack_nibbles(f["qs"], 64)
        if "qh" in f:
            q |= unpack_fields(f["qh"], 1, 8).reshape(b.shape[0], -1) << np.uint8(4)
        return {"codes": q} | cls._params(f)

    @classmethod
    def _decode(cls, p: Parts) -> Array:
        scale = p["d"].astype(F32) * p["sub_scale"].astype(F32)
        offset = p["dmin"].astype(F32) * p["sub_min"].astype(F32)
        q = p["codes"].reshape(-1, 8, 32).astype(F32)
        return (scale[:, :, None] * q - offset[:, :, None]).reshape(-1, 256)


class Q4_K(KQuant, type=GGMLType.Q4_K):
    search = (15, -1.0, 0.1, 20)
    layout = (("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128))
    code_fields = ("qs",)
    parts = (
        Part("codes", "uint8", 1, 0, 15),
        Part("sub_scale", "uint8", 32, 0, 63),
        Part("sub_min", "uint8", 32, 0, 63),
        Part("d", "float16", 256),
        Part("dmin", "float16", 256),
    )


class Q5_K(KQuant, type=GGMLType.Q5_K):
    search = (31, -0.5, 0.1, 15)
    layout = (("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128))
    code_fields = ("qh", "qs")
    parts = (
        Part("codes", "uint8", 1, 0, 31),
        Part("sub_scale", "uint8", 32, 0, 63),
        Part("sub_min", "uint8", 32, 0, 63),
        Part("d", "float16", 256),
        Part("dmin", "float16", 256),
    )


class Q6_K(Codec, type=GGMLType.Q6_K):
    """16 sub-blocks of 16, ``x = (d * sub_scale) * codes``, 6-bit ``q`` with ``codes = q - 32``.

    | bytes | field | content |
    |---|---|---|
    | 0-127 | ``ql`` | low 4 bits: byte ``64n + j`` low = element ``128n + j``, high = ``128n + 64 + j`` |
    | 128-191 | ``qh`` | high 2 bits: byte ``32n + l`` bits ``2k..2k+1`` = element ``128n + 32k + l`` |
    | 192-207 | ``scales`` | int8 sub-scales -> part ``sub_scale`` |
    | 208-209 | ``d`` | f16 super-block scale (last) -> part ``d`` |

    Quantize (``kquant.encode_q6_k``): per sub-block, ggml's ``make_qx_quants(16, 32, rmse_type=1)``;
    ``d = max_scale / -128`` (the signed scale of largest magnitude), ``sub_scale = MIN(127,
    nearest_int(-128 / max_scale * scale))``, ``codes = clamp(nearest_int(x / (d*sub_scale)), -32, 31)``.
    """

    layout = (("ql", 128), ("qh", 64), ("scales", 16), ("d", 2))
    code_fields = ("ql", "qh")
    parts = (
        Part("codes", "int8", 1, -32, 31),
        Part("sub_scale", "int8", 16, -128, 127),
        Part("d", "float16", 256),
    )

    @classmethod
    def _encode(cls, x: Array) -> Parts:
        return encode_q6_k(x)

    @classmethod
    def _pack(cls, p: Parts) -> Array:
        q = (p["codes"] + np.int8(32)).astype(np.uint8)
        ql = pack_nibbles(q, 128)
        qh = pack_fields((q >> 4).reshape(-1, 2, 4, 32), 2).reshape(q.shape[0], -1)
        return cls._assemble({"ql": ql, "qh": qh} | cls._param_fields(p))

    @classmethod
    def _unpack(cls, b: Array) -> Parts:
        f, n = cls._fields(b), b.shape[0]
        q = unpack_nibbles(f["ql"], 128) | (
            unpack_fields(f["qh"].reshape(n, 2, 32), 2, 4).reshape(n, -1) << np.uint8(4)
        )
        return {"codes": q.astype(np.int8) - np.int8(32)} | cls._params(f)

    @classmethod
    def _param_fields(cls, p: Parts) -> Parts:
        return {"scales": np.ascontiguousarray(p["sub_scale"]).view(np.uint8), "d": f16_bytes(p["d"])}

    @classmethod
    def _params(cls, f: Parts) -> Parts:
        return {"sub_scale": f["scales"].view(np.int8), "d": f16_of(f["d"])}

    @classmethod
    def _decode(cls, p: Parts) -> Array:
        scale = p["d"].astype(F32) * p["sub_scale"].astype(F32)
        return (scale[:, :, None] * p["codes"].reshape(-1, 16, 16).astype(F32)).reshape(-1, 256)

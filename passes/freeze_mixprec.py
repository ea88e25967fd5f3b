"""``freeze-semantics`` for ``q.source_mixprec``: a ``mixed-2416`` weight's streams become a ``mixprec``
descriptor (``qcompiler/ir/mixprec.py``), proven to decode to the source's own dequantize bit for bit.

Nothing is requantized or converted: codes, zero points, scale codes, second-level scales and zeros,
the precision map and the outliers keep their values and dtypes. The descriptor's rate claim counts
codes, qparams and exceptions (``rate_claim``, the same function the verifier recomputes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from qcompiler.errors import PassError
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import as_float32, read_array
from qcompiler.ir.core import Module, Op, create_op, narrow
from qcompiler.ir.descriptor import rate_claim
from qcompiler.ir.dtypes import DTYPES, code_dtype
from qcompiler.ir.ops.quant_mixprec import SourceMixprec
from qcompiler.ir.ops.shapes import dense
from qcompiler.ir.reference import DecodeError, decode
from qcompiler.ir.types import Alphabet, CodeContract, DenseType, GroupSpec, QuantType
from qcompiler.quant.describe import numpy_dtype_name

RATE_PARTS = ("codes", "scale", "zero", "exceptions")


def describe_mixprec(src: SourceMixprec, arrays: dict[str, np.ndarray], expressed: str, req: str) -> QuantType:
    """The ``mixprec`` descriptor of one source weight's arrays."""
    n, k = (int(d) for d in arrays["codes"].shape)
    g, g2 = src.group, src.group2
    u4, u8 = code_dtype("u4"), code_dtype("u8")
    assert u4 is not None
    assert u8 is not None

    def dense_of(name: str) -> DenseType:
        a = arrays[name]
        return DenseType(DTYPES[numpy_dtype_name(a)], tuple(int(d) for d in a.shape))

    scale = QuantType(
        "affine",
        CodeContract(u8, Alphabet(0, 255)),
        DenseType(DTYPES["f32"], (n, k // g)),
        GroupSpec(0, g2),
        (("scale", dense_of("scale2")), ("zero", dense_of("zero2"))),
        req="qparam",
    )
    t = QuantType(
        "mixprec",
        CodeContract(u4, Alphabet(0, 15)),
        DenseType(DTYPES[expressed], (n, k)),
        GroupSpec(1, g),
        (("scale", scale), ("zero", dense_of("zero"))),
        tuple((name, dense_of(name)) for name in ("col", "rowptr", "value", "wide", "wide_rows")),
        req=req,
    )
    return dataclasses.replace(t, rate=rate_claim(t, RATE_PARTS))


def parts_of(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """The nested binding the reference decoder and ``q.weight`` take."""
    scale = {"codes": arrays["scale_codes"], "scale": arrays["scale2"], "zero": arrays["zero2"]}
    return {
        "codes": arrays["codes"],
        "zero": arrays["zero"],
        "scale": scale,
        **{name: arrays[name] for name in ("wide", "wide_rows", "rowptr", "col", "value")},
    }


def refs_of(src: SourceMixprec) -> dict[str, AttrValue]:
    scale: dict[str, AttrValue] = {"codes": src.scale_codes, "scale": src.scale2, "zero": src.zero2}
    out: dict[str, AttrValue] = {"codes": src.codes, "zero": src.zero, "scale": scale}
    out.update({name: src.attrs[name] for name in ("wide", "wide_rows", "rowptr", "col", "value")})
    return out


def freeze_mixprec(m: Module, op: Op, req: str) -> Op:
    """Describe one ``q.source_mixprec`` weight and prove its reference decode equals ``effective``."""
    src = narrow(op, SourceMixprec)
    arrays = {name: read_array(m, ref.name) for name, ref in src.attrs.items() if isinstance(ref, SymbolRef)}
    name = src.codes.name.removesuffix(".codes")
    expressed = dense(op.result).dtype.name
    t = describe_mixprec(src, arrays, expressed, req)
    try:
        got = np.asarray(decode(t, parts_of(arrays)), dtype=np.float32)
    except DecodeError as e:
        raise PassError(f"tensor @{name}: the mixprec streams break a rule of the family: {e}") from None
    want = as_float32(arrays["effective"], m.tensors[src.effective.name].blob.dtype.name)
    same = got.view(np.uint32) == want.view(np.uint32)
    if not same.all():
        idx = tuple(int(i) for i in np.argwhere(~same)[0])
        raise PassError(
            f"tensor @{name}: the mixprec descriptor's reference decode differs from the source's dequantize at "
            f"{list(idx)} (expected {want[idx]!r}, got {got[idx]!r})"
        )
    return create_op("q.weight", [], [t], refs_of(src), [op.result.name])

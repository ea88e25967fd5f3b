"""What the ``triton`` target holds of a ``mixprec`` weight, and the ``MixKey`` its q.linear needs.

A ``mixprec`` weight is stored exactly in ``("mixprec", 1, "planes-a16")`` (the IR's own packed layout,
``qcompiler.ir.mixprec.PlanesLayout``) when the generated mixed 2/4-bit kernels (``mixprec_codegen``)
run it as it is:

| field | accepted |
|---|---|
| family | ``mixprec``, decoder 1, a 2-D Linear weight (``req=linear``) |
| codes | ``u4[0:15]``: 2-bit and 4-bit groups by the precision map ``wide`` |
| groups | along K, a multiple of 16 dividing K (the family's rule) |
| first level | ``zero`` u8 ``[N, K/G]``; ``scale`` second-level quantized (below) |
| second level | ``!q.affine`` codes u8, ``scale`` f16, ``zero`` u8, groups along N |
| outliers | CSR ``rowptr`` i16/i32 (i32 at load), ``col`` i16/i32, ``value`` f16 (replacement on a zero base) |
| act order, transforms | none |

Anything else (a dense first-level scale, an f32 second-level scale, f32 outliers) is a conversion,
refused by ``pack-layouts`` unless allowed: the kernels read ``s2`` and the outliers as fp16 and the
scale codes as bytes, and widening or rounding them at load would not be the stored weight.
"""

from __future__ import annotations

from qcompiler.backends.base import LayoutPlan, refused
from qcompiler.backends.triton.mixprec_codegen import MixKey
from qcompiler.ir.types import DenseType, PackSpec, QuantType
from qcompiler.runtime.kernels import Signature

PACK = PackSpec("mixprec", 1, "planes-a16", (1, 1))
NESTED = {"scale": ("f16",), "zero": ("u8",)}
"""The second level's qparams and the dtypes the kernels read them as."""
OUTLIER_DTYPES = {"rowptr": ("i16", "i32"), "col": ("i16", "i32"), "value": ("f16",)}
INT32_LIMIT = 2**31


def dense_dtype(t: QuantType | None, slot: str) -> str:
    v = None if t is None else (t.qparam(slot) or dict(t.exceptions).get(slot))
    return v.dtype.name if isinstance(v, DenseType) else "none"


def plan(name: str, t: QuantType) -> LayoutPlan:
    """How the triton target stores a ``mixprec`` weight: exactly in ``planes-a16``, or a conversion."""
    scale = t.qparam("scale")
    nested = scale if isinstance(scale, QuantType) else None
    n, k = (int(d) for d in t.shape) if t.rank == 2 else (0, 0)
    checks: list[tuple[bool, str]] = [
        (t.decoder == 1 and t.req == "linear", f"the mixprec kernels run Linear weights of decoder 1 (req={t.req})"),
        (t.rank == 2 and n * k < INT32_LIMIT, "a 2-D weight below 2^31 elements (int32 offsets)"),
        (t.perm is None and not t.transforms, "no act-order permutation or transform"),
        (dense_dtype(t, "zero") == "u8", "a u8 first-level zero point"),
        (
            nested is not None and nested.family == "affine" and nested.decoder == 1,
            "first-level scales second-level quantized (the kernels decode s1 = (codes - zero2) * scale2)",
        ),
        (
            nested is not None and nested.code.dtype.name == "u8" and nested.pack.family == "logical",
            "second-level scale codes as u8 bytes",
        ),
        (
            nested is not None and nested.group is not None and nested.group.axis == 0,
            "second-level groups along N",
        ),
        (
            nested is not None and set(dict(nested.qparams)) == set(NESTED),
            "a second-level scale and zero point (both)",
        ),
        *[
            (dense_dtype(nested, s) in dtypes, f"a second-level {s} in {'/'.join(dtypes)}")
            for s, dtypes in NESTED.items()
        ],
        *[(dense_dtype(t, s) in dtypes, f"outlier {s} in {'/'.join(dtypes)}") for s, dtypes in OUTLIER_DTYPES.items()],
    ]
    no = refused(checks)
    return no if no is not None else LayoutPlan("exact", pack=PACK)


def group2(t: QuantType) -> int:
    scale = t.qparam("scale")
    assert isinstance(scale, QuantType)
    assert scale.group is not None
    return scale.group.size


def outliers(t: QuantType) -> int:
    return int(dict(t.exceptions)["col"].shape[0])


def key_of(sig: Signature, t: QuantType) -> MixKey:
    """The mixprec kernel key of a q.linear's runtime signature and its weight's descriptor."""
    assert t.group is not None
    return MixKey(
        act=sig.activation,
        out=sig.output,
        group=t.group.size,
        group2=group2(t),
        bias=sig.bias,
        outliers=outliers(t) > 0,
    )

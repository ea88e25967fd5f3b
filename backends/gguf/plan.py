"""Which ggml type holds each tensor, and the GGUF inventory: format knowledge as tables.

A quantized weight maps to a ggml type only when its codes and qparams are exactly what the block
stores:

| descriptor | ggml type | IR code layout |
|---|---|---|
| affine, i8 [-128:127], groups of 32 along K, f16 scale, no zero point | Q8_0 | ``ggml`` v1 ``q8_0`` |
| affine, i4 [-8:7], same | Q4_0 | ``ggml`` v1 ``q4_0`` |
| affine, i5 [-16:15], same | Q5_0 | ``ggml`` v1 ``q5_0`` |

An affine weight whose only difference is float32 scales (the built-in ``w8-g32``/``w4-g32``) needs
the ``scale-dtype`` conversion to f16. Two rewrites keep the codes and the decode (``passes/refine.py``,
no flag needed): groups of a multiple of 32 repeat their scale per block (``regroup``), and an
asymmetric 4/5-bit weight becomes Q4_1/Q5_1's ``d*u + m`` (``affine-min``; a conversion when some
``m = -d*z`` is not an f16). Anything else needs ``dense``. Dense tensors keep their dtype
(F32/F16/BF16), except 1-D ones (norms, biases), which llama.cpp adds to F32 activations and so
must be F32 (widened exactly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qcompiler.backends.base import ContainerTensor, LayoutPlan, dense_plan, refused
from qcompiler.backends.gguf.archs import Arch
from qcompiler.backends.gguf.ggml_types import BLOCKS, GGMLType
from qcompiler.ir.attrs import SymbolRef
from qcompiler.ir.core import Module, Op
from qcompiler.ir.module_attrs import source_formats
from qcompiler.ir.types import DenseType, PackSpec, QuantType

EXACT: dict[tuple[str, int, bool], tuple[str, GGMLType]] = {
    ("affine", 8, True): ("q8_0", GGMLType.Q8_0),
    ("affine", 4, True): ("q4_0", GGMLType.Q4_0),
    ("affine", 5, True): ("q5_0", GGMLType.Q5_0),
}
"""(family, code bits, signed) -> (ggml code layout encoding, ggml type)."""
NESTED_EXACT: dict[tuple[str, int, str, int], tuple[str, GGMLType]] = {
    ("u4", 32, "u6", 8): ("q4_k", GGMLType.Q4_K),
    ("u5", 32, "u6", 8): ("q5_k", GGMLType.Q5_K),
    ("i6", 16, "i8", 16): ("q6_k", GGMLType.Q6_K),
}
"""(codes, group, sub-scale codes, sub-scales per super-block scale) -> K-quant encoding and type."""
MIN_EXACT: dict[str, tuple[str, GGMLType]] = {"u4": ("q4_1", GGMLType.Q4_1), "u5": ("q5_1", GGMLType.Q5_1)}
"""Nested codes with dense f16 scale and min per 32 (``x = d*q + m``, IR ``min = -m``) -> Q4_1/Q5_1."""
NEGATED_MIN = ("q4_1", "q5_1")
ASYM = {4: "Q4_1", 5: "Q5_1"}
"""Code bits of an asymmetric affine weight -> the ggml type holding it once written ``d*u - min``."""
"""Encodings whose block stores ``m`` while the IR's nested ``min`` slot holds ``-m``."""
DENSE: dict[str, GGMLType] = {"f32": GGMLType.F32, "f16": GGMLType.F16, "bf16": GGMLType.BF16}
ENCODING_TYPE = dict(
    [*EXACT.values(), *NESTED_EXACT.values(), *MIN_EXACT.values(), ("tq2_0", GGMLType.TQ2_0), ("tq1_0", GGMLType.TQ1_0)]
)
NESTED_PARTS = {
    "codes": "codes",
    "scale.codes": "sub_scale",
    "scale.scale": "d",
    "min.codes": "sub_min",
    "min.scale": "dmin",
}
"""Binding path of a K-quant descriptor -> its codec part."""
GGUF_FILE = "model.gguf"
GRAPH_FILE = "graph.safetensors"


def sub_scale_ok(s: object, per: int, code: str) -> bool:
    """A K-quant sub-block qparam: full-range ``code`` codes, groups of ``per``, one f16 scale each."""
    if not isinstance(s, QuantType) or s.family != "affine" or s.code.dtype.name != code:
        return False
    scale = s.qparam("scale")
    full = (s.code.dtype.min, s.code.dtype.max) == (s.code.alphabet.lo, s.code.alphabet.hi)
    group_ok = s.group is not None and s.group.axis == 1 and s.group.size == per
    return (
        full
        and group_ok
        and set(dict(s.qparams)) == {"scale"}
        and isinstance(scale, DenseType)
        and scale.dtype.name == "f16"
    )


def plan_min(t: QuantType) -> LayoutPlan | None:
    """Q4_1/Q5_1 when ``t`` is exactly one: codes u4/u5 in groups of 32 along K, f16 scale and min."""
    scale, low = t.qparam("scale"), t.qparam("min")
    if not (isinstance(scale, DenseType) and isinstance(low, DenseType) and t.code.dtype.name in MIN_EXACT):
        return None
    encoding, gt = MIN_EXACT[t.code.dtype.name]
    checks = [
        (
            t.rank == 2 and t.group is not None and t.group.axis == 1 and t.group.size == 32,
            f"{gt.name} blocks hold 32 codes along K",
        ),
        (t.rank == 2 and int(t.shape[1]) % 32 == 0, "K must be a multiple of 32"),
        ((t.code.alphabet.lo, t.code.alphabet.hi) == (t.code.dtype.min, t.code.dtype.max), "restricted alphabet"),
        (scale.dtype.name == "f16" and low.dtype.name == "f16", f"{gt.name} stores f16 scale and min"),
        (
            t.perm is None and not t.exceptions and not t.transforms,
            "permutations, exceptions and transforms have no ggml form",
        ),
    ]
    no = refused(checks)
    if no is not None:
        return no
    return LayoutPlan("exact", pack=PackSpec("ggml", 1, encoding, (1, 32)))


def plan_nested(t: QuantType) -> LayoutPlan:
    with_min = plan_min(t)
    if with_min is not None:
        return with_min
    scale = t.qparam("scale")
    sub = scale.code.dtype.name if isinstance(scale, QuantType) else ""
    per = scale.group.size if isinstance(scale, QuantType) and scale.group is not None else 0
    key = (t.code.dtype.name, t.group.size if t.group is not None else 0, sub, per)
    if key not in NESTED_EXACT:
        return dense_plan(
            f"no ggml K-quant holds {t.code.dtype.name} codes in groups of {key[1]} with {sub or 'dense'} sub-scales"
        )
    encoding, gt = NESTED_EXACT[key]
    slots = {"scale", "min"} if gt != GGMLType.Q6_K else {"scale"}
    checks = [
        (
            t.rank == 2 and t.group is not None and t.group.axis == 1 and int(t.shape[1]) % 256 == 0,
            "K-quant super-blocks hold 256 codes along K",
        ),
        ((t.code.alphabet.lo, t.code.alphabet.hi) == (t.code.dtype.min, t.code.dtype.max), "restricted alphabet"),
        (
            set(dict(t.qparams)) == slots and all(sub_scale_ok(s, per, sub) for _, s in t.qparams),
            f"{gt.name} sub-block qparams",
        ),
        (
            t.perm is None and not t.exceptions and not t.transforms,
            "permutations, exceptions and transforms have no ggml form",
        ),
    ]
    no = refused(checks)
    if no is not None:
        return no
    return LayoutPlan("exact", pack=PackSpec("ggml-k", 1, encoding, (1, 256)))


TERNARY = {"TQ2_0": "tq2_0", "TQ1_0": "tq1_0"}
"""Both hold ternary codes in groups of 256 exactly: TQ2_0 (2.06 bits, faster) unless the source chose TQ1_0."""


def plan_ternary(t: QuantType, prefer: str = "") -> LayoutPlan:
    """TQ2_0 (or TQ1_0 when ``prefer`` says so): codes {-1, 0, 1} in groups of 256 along K, one f16 scale each."""
    scale = t.qparam("scale")
    checks = [
        (
            t.rank == 2 and t.group is not None and t.group.axis == 1 and t.group.size == 256,
            "TQ2_0 blocks hold 256 codes along K",
        ),
        (t.rank == 2 and int(t.shape[1]) % 256 == 0, "K must be a multiple of 256"),
        (isinstance(scale, DenseType) and scale.dtype.name == "f16", "TQ2_0 stores one f16 scale per block"),
        (
            t.perm is None and not t.exceptions and not t.transforms,
            "permutations, exceptions and transforms have no ggml form",
        ),
    ]
    no = refused(checks)
    if no is not None:
        return no
    return LayoutPlan("exact", pack=PackSpec("ggml-k", 1, TERNARY.get(prefer, "tq2_0"), (1, 256)))


def plan(name: str, t: QuantType, prefer: str = "") -> LayoutPlan:
    if t.family == "nested":
        return plan_nested(t)
    if t.family == "ternary":
        return plan_ternary(t, prefer)
    key = (t.family, t.code.dtype.bits, t.code.dtype.signed)
    if key not in EXACT:
        return dense_plan(f"no ggml block holds {t.family} {t.code.dtype.name} codes")
    encoding, gt = EXACT[key]
    bits = t.code.dtype.bits
    checks: list[tuple[bool, str]] = [
        (t.rank == 2 and t.group is not None and t.group.axis == 1, "ggml blocks run along K (axis 1) of a matrix"),
        (
            t.group is not None and t.group.size % 32 == 0,
            f"ggml {gt.name} blocks hold 32 codes, not a group of {t.group.size if t.group else 'all'}",
        ),
        (t.rank == 2 and int(t.shape[1]) % 32 == 0, "K must be a multiple of 32"),
        (
            (t.code.alphabet.lo, t.code.alphabet.hi) == (-(1 << (bits - 1)), (1 << (bits - 1)) - 1),
            "restricted alphabet",
        ),
        (
            set(dict(t.qparams)) == {"scale"} or (bits in ASYM and set(dict(t.qparams)) == {"scale", "zero"}),
            f"{gt.name} is symmetric: a zero point has no place in its block",
        ),
        (
            t.perm is None and not t.exceptions and not t.transforms,
            "permutations, exceptions and transforms have no ggml form",
        ),
    ]
    no = refused(checks)
    if no is not None:
        return no
    scale = t.qparam("scale")
    if not isinstance(scale, DenseType):
        return dense_plan("nested scales")
    assert t.group is not None
    if t.group.size != 32:
        reason = f"ggml blocks hold 32 codes: each group of {t.group.size} repeats its scale per block"
        return LayoutPlan("refine", convert="regroup", to="32", reason=reason)
    if scale.dtype.name != "f16":
        return LayoutPlan(
            "conversion",
            convert="scale-dtype",
            to="f16",
            reason=f"ggml {gt.name} stores f16 scales, not {scale.dtype.name}",
        )
    if t.qparam("zero") is not None:
        reason = f"{ASYM[bits]} stores d and m = -d*z per block (exact when d*z is an f16)"
        return LayoutPlan("refine", convert="affine-min", reason=reason)
    return LayoutPlan("exact", pack=PackSpec("ggml", 1, encoding, (1, 32)))


@dataclass(frozen=True)
class GgufWeight:
    hf: str
    op: Op
    t: QuantType
    refs: dict[str, str]
    """Binding path (``codes``, ``scale``, ``scale.codes`` ...) -> tensor-table name."""


def flat_refs(binding: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in binding.items():
        if isinstance(v, SymbolRef):
            out[prefix + k] = v.name
        elif isinstance(v, dict):
            out.update(flat_refs(v, f"{prefix}{k}."))  # pyright: ignore[reportUnknownArgumentType]
    return out


def gguf_weights(m: Module) -> dict[str, GgufWeight]:
    """Quantized weights by their codes tensor name."""
    out: dict[str, GgufWeight] = {}
    for op in m.ops():
        t = op.results[0].quant if op.name == "q.weight" else None
        if t is None:
            continue
        refs = flat_refs(op.attrs)
        out[refs["codes"]] = GgufWeight(refs["codes"].removesuffix(".codes"), op, t, refs)
    return out


def ggml_type_of(w: GgufWeight, prefer: str = "") -> GGMLType:
    if w.t.pack.family in ("ggml", "ggml-k"):
        return ENCODING_TYPE[w.t.pack.encoding]
    p = plan(w.hf, w.t, prefer)
    if p.kind == "exact" and p.pack is not None:
        return ENCODING_TYPE[p.pack.encoding]
    if p.convert == "scale-dtype" and w.t.family != "nested":
        return EXACT[(w.t.family, w.t.code.dtype.bits, w.t.code.dtype.signed)][1]
    return DENSE.get(w.t.expressed.dtype.name, GGMLType.F32)


def nbytes(gt: GGMLType, shape: tuple[int, ...]) -> int:
    block, size = BLOCKS[gt]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * (shape[-1] // block) * size


def transposed_dense(m: Module) -> set[str]:
    """Dense tensors every use of which reads ``transpose(const) {perm = [1, 0]}``: a weight the source
    stores ``[K, N]`` (``Conv1D``, lowered from ``addmm``) that a ``linear`` takes as ``[N, K]``.
    ggml wants ``[N, K]`` rows, so the GGUF holds the transpose (a pure permutation; the location's
    ``!t`` turns it back for ``graph.qir``)."""
    uses: dict[int, tuple[Op, list[Op]]] = {}
    for op in m.ops():
        for v in op.operands:
            if v.producer is not None and v.producer.name == "const":
                uses.setdefault(id(v), (v.producer, []))[1].append(op)
    only_transposed: dict[str, bool] = {}  # tensor -> whether every use of every const of it transposes
    for const, users in uses.values():
        ref = const.attrs.get("ref")
        if isinstance(ref, SymbolRef):
            flips = all(u.name == "transpose" and u.attrs.get("perm") == [1, 0] for u in users)
            only_transposed[ref.name] = only_transposed.get(ref.name, True) and flips
    return {name for name, flips in only_transposed.items() if flips}


def container_tensors(m: Module, arch: Arch | None) -> list[ContainerTensor]:
    """The GGUF tensors (ggml type name as dtype) in tensor-table order, then graph-only tensors; a
    ``transposed_dense`` tensor with the transpose's shape."""
    weights = gguf_weights(m)
    flipped = transposed_dense(m) if arch is not None else set[str]()
    prefer = source_formats(m)
    owned = {name: w for w in weights.values() for name in w.refs.values()}
    out: list[ContainerTensor] = []
    for name, decl in m.tensors.items():
        w = owned.get(name)
        if w is not None and name != w.refs["codes"]:
            continue
        hf = w.hf if w is not None else name
        gguf = arch.gguf_name(hf) if arch is not None else None
        if w is None and (gguf is None or decl.attrs.get("role") == "constant"):
            out.append(ContainerTensor(name, decl.blob.dtype.name, decl.blob.shape, decl.blob.nbytes, (name,), "graph"))
            continue
        if w is not None:
            gt, owners = ggml_type_of(w, prefer.get(w.hf, "")), tuple(w.refs.values())
            shape = tuple(int(d) for d in w.t.shape)
        else:
            shape, owners = decl.blob.shape[::-1] if name in flipped else decl.blob.shape, (name,)
            gt = GGMLType.F32 if len(shape) == 1 else DENSE.get(decl.blob.dtype.name, GGMLType.F32)
        out.append(ContainerTensor(gguf or hf, gt.name.lower(), shape, nbytes(gt, shape), owners))
    return out

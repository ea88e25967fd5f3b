"""What the safetensors backend stores, and under which names: format knowledge as tables.

A quantized Linear weight ``X.weight`` (``q.weight {codes = @X.weight.codes, scale = ..., zero = ...}``)
becomes compressed-tensors ``pack-quantized`` tensors:

| container tensor | from | dtype | shape |
|---|---|---|---|
| ``X.weight_packed`` | codes in layout ``ct-pack-quantized`` v1 | I32 | ``[N, ceil(K*b/32)]`` |
| ``X.weight_scale`` | scale | the model dtype (or the graph's compute dtype) | ``[N, K/G]`` or ``[N, 1]`` (channel) |
| ``X.weight_zero_point`` | zero (asymmetric only), packed along dim 0 | I32 | ``[ceil(N*b/32), K/G or 1]`` |
| ``X.weight_shape`` | the logical shape | I64 | ``[2]`` |

Every other tensor keeps its name and dtype; tensors the model's state dict does not hold
(``role = "constant"``, e.g. a non-persistent rotary buffer) go to ``graph.safetensors``, which only
``graph.qir`` reads. ``plan`` says what compressed-tensors can hold exactly; everything else is a
conversion, except a ``mixprec`` weight (2/4-bit groups, nested scales, outliers), which has no
compressed-tensors form and is stored exactly in our own schema (``mixprec_schema.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qcompiler.backends.base import ContainerTensor, LayoutPlan, dense_plan, refused
from qcompiler.backends.safetensors import mixprec_schema
from qcompiler.backends.safetensors.layouts import words_per_row
from qcompiler.ir.attrs import SymbolRef
from qcompiler.ir.core import Module, Op
from qcompiler.ir.types import DenseType, PackSpec, QuantType

ST_DTYPE: dict[str, str] = {
    "f64": "F64",
    "f32": "F32",
    "f16": "F16",
    "bf16": "BF16",
    "i64": "I64",
    "i32": "I32",
    "i16": "I16",
    "i8": "I8",
    "u8": "U8",
    "bool": "BOOL",
    "f8e4m3": "F8_E4M3",
}
"""IR dtype name -> safetensors dtype string."""
IR_DTYPE = {v: k for k, v in ST_DTYPE.items()}

CT_PACK = PackSpec("ct-pack-quantized", 1, "offset-binary-lsb", (1, 1))
CT_FLOAT8 = PackSpec("ct-float8", 1, "e4m3fn", (1, 1))
CT_BITS = range(2, 9)
"""Code widths written as pack-quantized (compressed-tensors packs 1-8; 1-bit signed codes are not useful)."""
SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
GRAPH_FILE = "graph.safetensors"
INDEX = "model.safetensors.index.json"


def plan(name: str, t: QuantType, model_dtype: str = "") -> LayoutPlan:
    """How compressed-tensors ``pack-quantized`` stores ``t``: exactly, or through a conversion.
    Scales are kept in the model dtype (``model_dtype``, what the config declares, as llmcompressor
    writes them) or in the dtype the graph computes in."""
    if t.family == "f8e4m3":
        return plan_float8(t, model_dtype)
    if t.family == "mixprec":
        return mixprec_schema.plan(t)
    bits = t.code.dtype.bits
    full = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    checks: list[tuple[bool, str]] = [
        (t.family == "affine", f"compressed-tensors holds affine integer codes, not family '{t.family}'"),
        (t.req == "linear" and t.rank == 2, f"compressed-tensors quantizes Linear weights only (req={t.req})"),
        (t.code.dtype.signed, "compressed-tensors stores signed codes; these are unsigned"),
        (bits in CT_BITS, f"pack-quantized holds 2-8 bit codes, not {bits}"),
        (
            (t.code.alphabet.lo, t.code.alphabet.hi) == full,
            f"alphabet {t.code.alphabet} is not the full {bits}-bit range",
        ),
        (t.perm is None, "act-order permutation: compressed-tensors >= 0.20 has no g_idx"),
        (not t.exceptions and not t.transforms, "exceptions and transforms have no compressed-tensors form"),
        (set(dict(t.qparams)) in ({"scale"}, {"scale", "zero"}), "qparams other than scale and zero"),
        (all(isinstance(s, DenseType) for _, s in t.qparams), "nested qparams"),
        (
            t.group is not None and t.group.axis == 1,
            "per-tensor or non-K grouping (compressed-tensors needs channel/group)",
        ),
    ]
    no = refused(checks)
    if no is not None:
        return no
    assert t.group is not None
    k = int(t.shape[1])
    if t.group.size != k and k % t.group.size:
        return dense_plan(f"K={k} is not a multiple of the group size {t.group.size} (a partial tail group)")
    scale = t.qparam("scale")
    assert isinstance(scale, DenseType)
    model = model_dtype or t.expressed.dtype.name
    if scale.dtype.name not in (model, t.expressed.dtype.name):
        return LayoutPlan(
            "conversion",
            convert="scale-dtype",
            reason=f"compressed-tensors keeps scales in the model dtype {model}, not {scale.dtype.name}",
        )
    return LayoutPlan("exact", pack=CT_PACK)


def plan_float8(t: QuantType, model_dtype: str) -> LayoutPlan:
    """FP8 codes are stored as they are (``float-quantized``: the ``F8_E4M3`` weight is the codes'
    bytes), with one scale per tensor, per output channel or per group of K."""
    no = refused(
        [
            (t.req == "linear" and t.rank == 2, f"compressed-tensors quantizes Linear weights only (req={t.req})"),
            (t.perm is None and not t.exceptions and not t.transforms, "FP8 weights have no g_idx or exceptions"),
            (t.group is None or t.group.axis == 1, "FP8 scales are per tensor, per channel or grouped along K"),
        ]
    )
    if no is not None:
        return no
    scale = t.qparam("scale")
    assert isinstance(scale, DenseType)
    model = model_dtype or t.expressed.dtype.name
    if scale.dtype.name not in (model, t.expressed.dtype.name, "f32"):
        return LayoutPlan(
            "conversion",
            convert="scale-dtype",
            reason=f"compressed-tensors keeps scales in the model dtype {model}, not {scale.dtype.name}",
        )
    return LayoutPlan("exact", pack=CT_FLOAT8)


@dataclass(frozen=True)
class Weight:
    """A ``q.weight`` op and its bound tensor-table names."""

    name: str
    op: Op
    t: QuantType
    codes: str
    scale: str
    zero: str | None

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")


def quant_weights(m: Module) -> list[Weight]:
    out: list[Weight] = []
    for op in m.ops():
        t = op.results[0].quant if op.name == "q.weight" else None
        if t is None:
            continue
        refs = {k: v.name for k, v in op.attrs.items() if isinstance(v, SymbolRef)}
        if "scale" not in refs:  # nested qparams (a K-quant source): pack-layouts refuses or converts it
            continue
        name = refs["codes"].removesuffix(".codes")
        out.append(Weight(name, op, t, refs["codes"], refs["scale"], refs.get("zero")))
    return out


def weight_tensors(w: Weight) -> list[ContainerTensor]:
    """The pack-quantized (or float-quantized) tensors of one weight (``plan`` must have said exact
    or scale-dtype)."""
    n, k = (int(d) for d in w.t.shape)
    bits = w.t.code.dtype.bits
    scale = w.t.qparam("scale")
    assert isinstance(scale, DenseType)
    sdt = scale.dtype
    owners = (w.codes, w.scale) + ((w.zero,) if w.zero else ())
    if w.t.family == "f8e4m3":
        sshape = (1,) if w.t.group is None else tuple(int(d) for d in scale.shape)
        return [
            ContainerTensor(f"{w.module}.weight", "f8e4m3", (n, k), n * k, owners),
            ContainerTensor(f"{w.module}.weight_scale", sdt.name, sshape, math.prod(sshape) * sdt.itemsize, owners),
        ]
    assert w.t.group is not None
    groups = tuple(int(d) for d in scale.shape)
    out = [
        ContainerTensor(
            f"{w.module}.weight_packed", "i32", (n, words_per_row(k, bits)), n * words_per_row(k, bits) * 4, owners
        ),
        ContainerTensor(f"{w.module}.weight_scale", sdt.name, groups, groups[0] * groups[1] * sdt.itemsize, owners),
        ContainerTensor(f"{w.module}.weight_shape", "i64", (2,), 16, owners),
    ]
    if w.zero:
        zshape = (words_per_row(n, bits), groups[1])
        out.insert(
            2, ContainerTensor(f"{w.module}.weight_zero_point", "i32", zshape, zshape[0] * zshape[1] * 4, owners)
        )
    return out


def container_tensors(m: Module) -> list[ContainerTensor]:
    """Every tensor the container will hold, in tensor-table order, with exact byte sizes."""
    by_codes = {w.codes: w for w in quant_weights(m)}
    owned = {name for w in by_codes.values() for name in (w.codes, w.scale, w.zero) if name}
    mix = {w.refs["codes"]: w for w in mixprec_schema.mixprec_weights(m)}
    owned |= {name for w in mix.values() for name in w.refs.values()}
    out: list[ContainerTensor] = []
    for name, decl in m.tensors.items():
        if name in mix:
            out += mixprec_schema.weight_tensors(m, mix[name])
            continue
        w = by_codes.get(name)
        if w is not None:
            p = LayoutPlan("exact") if w.t.pack in (CT_PACK, CT_FLOAT8) else plan(w.name, w.t)
            if p.convert == "dense":
                size = w.t.expressed.dtype.itemsize * int(w.t.shape[0]) * int(w.t.shape[1])
                out.append(
                    ContainerTensor(w.name, w.t.expressed.dtype.name, tuple(int(d) for d in w.t.shape), size, (name,))
                )
            else:
                out += weight_tensors(w)
            continue
        if name in owned:
            continue
        where = "graph" if decl.attrs.get("role") == "constant" else "model"
        out.append(ContainerTensor(name, decl.blob.dtype.name, decl.blob.shape, decl.blob.nbytes, (name,), where))
    return out


def shard_file_names(count: int) -> list[str]:
    """HF names: ``model.safetensors``, or ``model-00001-of-00003.safetensors`` ... when sharded."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]

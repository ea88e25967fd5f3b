"""Which ggml type holds each tensor, and the GGUF inventory: format knowledge as tables.

A quantized weight maps to a ggml type only when its codes and qparams are exactly what the block
stores:

| descriptor | ggml type | IR code layout |
|---|---|---|
| affine, i8 [-128:127], groups of 32 along K, f16 scale, no zero point | Q8_0 | ``ggml`` v1 ``q8_0`` |
| affine, i4 [-8:7], same | Q4_0 | ``ggml`` v1 ``q4_0`` |
| affine, i5 [-16:15], same | Q5_0 | ``ggml`` v1 ``q5_0`` |

An affine weight whose only difference is float32 scales (the built-in ``w8-g32``/``w4-g32``) needs
the ``scale-dtype`` conversion to f16; anything else needs ``dense``. Dense tensors keep their dtype
(F32/F16/BF16), except 1-D ones (norms, biases), which llama.cpp adds to F32 activations and so
must be F32 (widened exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

from qcompiler.backends.base import ContainerTensor, LayoutPlan
from qcompiler.backends.gguf.archs import Arch
from qcompiler.backends.gguf.ggml_types import BLOCKS, GGMLType
from qcompiler.ir.attrs import SymbolRef
from qcompiler.ir.core import Module, Op
from qcompiler.ir.types import DenseType, PackSpec, QuantType

EXACT: dict[tuple[str, int, bool], tuple[str, GGMLType]] = {
    ("affine", 8, True): ("q8_0", GGMLType.Q8_0),
    ("affine", 4, True): ("q4_0", GGMLType.Q4_0),
    ("affine", 5, True): ("q5_0", GGMLType.Q5_0),
}
"""(family, code bits, signed) -> (ggml code layout encoding, ggml type)."""
DENSE: dict[str, GGMLType] = {"f32": GGMLType.F32, "f16": GGMLType.F16, "bf16": GGMLType.BF16}
ENCODING_TYPE = dict(EXACT.values())
GGUF_FILE = "model.gguf"
GRAPH_FILE = "graph.safetensors"


def dense(reason: str) -> LayoutPlan:
    return LayoutPlan("conversion", convert="dense", reason=reason)


def plan(name: str, t: QuantType) -> LayoutPlan:
    key = (t.family, t.code.dtype.bits, t.code.dtype.signed)
    if key not in EXACT:
        return dense(f"no ggml block holds {t.family} {t.code.dtype.name} codes")
    encoding, gt = EXACT[key]
    bits = t.code.dtype.bits
    checks: list[tuple[bool, str]] = [
        (t.rank == 2 and t.group is not None and t.group.axis == 1, "ggml blocks run along K (axis 1) of a matrix"),
        (
            t.group is not None and t.group.size == 32,
            f"ggml {gt.name} blocks hold 32 codes, not a group of {t.group.size if t.group else 'all'}",
        ),
        (t.rank == 2 and int(t.shape[1]) % 32 == 0, "K must be a multiple of 32"),
        (
            (t.code.alphabet.lo, t.code.alphabet.hi) == (-(1 << (bits - 1)), (1 << (bits - 1)) - 1),
            "restricted alphabet",
        ),
        (set(dict(t.qparams)) == {"scale"}, f"{gt.name} is symmetric: a zero point has no place in its block"),
        (
            t.perm is None and not t.exceptions and not t.transforms,
            "permutations, exceptions and transforms have no ggml form",
        ),
    ]
    for ok, reason in checks:
        if not ok:
            return dense(reason)
    scale = t.qparam("scale")
    if not isinstance(scale, DenseType):
        return dense("nested scales")
    if scale.dtype.name != "f16":
        return LayoutPlan(
            "conversion",
            convert="scale-dtype",
            to="f16",
            reason=f"ggml {gt.name} stores f16 scales, not {scale.dtype.name}",
        )
    return LayoutPlan("exact", pack=PackSpec("ggml", 1, encoding, (1, 32)))


@dataclass(frozen=True)
class GgufWeight:
    hf: str
    op: Op
    t: QuantType
    refs: dict[str, str]


def gguf_weights(m: Module) -> dict[str, GgufWeight]:
    """Quantized weights by their codes tensor name."""
    out: dict[str, GgufWeight] = {}
    for op in m.ops():
        t = op.results[0].quant if op.name == "q.weight" else None
        if t is None:
            continue
        refs = {k: v.name for k, v in op.attrs.items() if isinstance(v, SymbolRef)}
        out[refs["codes"]] = GgufWeight(refs["codes"].removesuffix(".codes"), op, t, refs)
    return out


def ggml_type_of(w: GgufWeight) -> GGMLType:
    if w.t.pack.family == "ggml":
        return ENCODING_TYPE[w.t.pack.encoding]
    p = plan(w.hf, w.t)
    if p.kind == "exact" and p.pack is not None:
        return ENCODING_TYPE[p.pack.encoding]
    if p.convert == "scale-dtype":
        return EXACT[(w.t.family, w.t.code.dtype.bits, w.t.code.dtype.signed)][1]
    return DENSE.get(w.t.expressed.dtype.name, GGMLType.F32)


def nbytes(gt: GGMLType, shape: tuple[int, ...]) -> int:
    block, size = BLOCKS[gt]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * (shape[-1] // block) * size


def container_tensors(m: Module, arch: Arch | None) -> list[ContainerTensor]:
    """The GGUF tensors (ggml type name as dtype) in tensor-table order, then graph-only tensors."""
    weights = gguf_weights(m)
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
            gt, shape, owners = ggml_type_of(w), tuple(int(d) for d in w.t.shape), tuple(w.refs.values())
        else:
            shape, owners = decl.blob.shape, (name,)
            gt = GGMLType.F32 if len(shape) == 1 else DENSE.get(decl.blob.dtype.name, GGMLType.F32)
        out.append(ContainerTensor(gguf or hf, gt.name.lower(), shape, nbytes(gt, shape), owners))
    return out

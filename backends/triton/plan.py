"""What the ``triton`` target holds exactly, and which kernels a module needs: format knowledge as tables.

A quantized weight is stored in ``triton-kn`` v1 (``layouts.py``) when the generated kernels run it
as it is:

| field | accepted |
|---|---|
| family | ``affine``, decoder 1, 2-D, used as a Linear weight or an embedding table (or both, tied); |
| | ``f8e4m3`` (FP8 bit patterns), decoder 1, a Linear weight grouped along K or per channel |
| codes | 2, 4 or 8 bits, signed or unsigned, any alphabet inside the width |
| qparams | a dense ``scale`` (f16, bf16, f32), optionally an integer ``zero`` (i8, u8, i16, i32) |
| groups | along K: per channel, or a power of two >= 16 dividing K |
| act order | a permutation of K (``perm``) |
| exceptions, transforms | none |

A ``mixprec`` weight is stored in its own ``("mixprec", 1, "planes-a16")`` layout when the mixed 2/4-bit
kernels run it (``mixprec_plan.py``). ``FAMILIES`` maps each family to its plan and kernel key.

Anything else is a conversion (``dense``), refused by ``pack-layouts`` unless allowed.
Every tensor is stored in ``model.safetensors`` under its tensor-table name, codes in the layout,
qparams as the IR holds them (``[N, groups]``; the loader transposes them once on the device).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

from qcompiler.backends.base import ContainerTensor, LayoutPlan, refused
from qcompiler.backends.triton import mixprec_plan
from qcompiler.backends.triton.codegen import BITS, TL_DTYPE, KernelKey
from qcompiler.ir.core import Module, Op
from qcompiler.ir.layouts import find_layout
from qcompiler.ir.ops.quant import weight_name
from qcompiler.ir.types import DenseType, PackSpec, QuantType
from qcompiler.runtime.kernels import Place, Signature, quantized_ops, signature

MIN_GROUP = 16
ZERO_DTYPES = ("i8", "u8", "i16", "i32")
MODEL_FILE = "model.safetensors"
KERNEL_DIR = "kernels"
INDEX_FILE = f"{KERNEL_DIR}/index.json"


def group_size(t: QuantType) -> int:
    """The group along K, 0 when per channel."""
    k = int(t.shape[1])
    return 0 if t.group is None or t.group.size == k else t.group.size


def plan_affine(name: str, t: QuantType) -> LayoutPlan:
    """How the triton target stores an affine or float8 ``t``: exactly in ``triton-kn``, or through a conversion."""
    bits = t.code.dtype.bits
    scale = t.qparam("scale")
    zero = t.qparam("zero")
    k = int(t.shape[1]) if t.rank == 2 else 0
    group = group_size(t) if t.rank == 2 else 0
    checks: list[tuple[bool, str]] = [
        (
            t.decoder == 1 and (t.family == "affine" or (t.family == "f8e4m3" and t.req == "linear")),
            f"the kernels decode affine v1 codes and float8 linear weights, not {t.family} v{t.decoder} (req={t.req})",
        ),
        (t.family != "f8e4m3" or t.group is not None, "float8 scales per channel or group (not one per tensor)"),
        (t.rank == 2, "a 2-D weight"),
        (bits in BITS, f"the kernels read 2, 4 or 8-bit codes, not {bits}"),
        (set(dict(t.qparams)) <= {"scale", "zero"}, "qparams other than scale and zero"),
        (isinstance(scale, DenseType) and scale.dtype.name in TL_DTYPE, f"a dense f16/bf16/f32 scale, not {scale}"),
        (zero is None or (isinstance(zero, DenseType) and zero.dtype.name in ZERO_DTYPES), "an integer zero point"),
        (t.group is None or t.group.axis == 1, "groups along K"),
        (k % (8 // bits) == 0 if k else False, f"K a multiple of {8 // max(bits, 1)} (codes per byte)"),
        (
            group == 0 or (group >= MIN_GROUP and group & (group - 1) == 0 and k % group == 0),
            f"per-channel scales or a power-of-two group >= {MIN_GROUP} dividing K (group {group}, K {k})",
        ),
        (not t.exceptions and not t.transforms, "no exceptions or transforms"),
    ]
    no = refused(checks)
    if no is not None:
        return no
    return LayoutPlan("exact", pack=PackSpec("triton-kn", 1, f"b{bits}", (1, 8 // bits)))


def key_of(sig: Signature, t: QuantType) -> KernelKey:
    """The kernel key of an op's runtime signature (the key is the part of it the codegen specialises on)."""
    return KernelKey(
        op=sig.op.removeprefix("q."),
        bits=int(sig.codes[1:]),
        signed=sig.codes.startswith("i"),
        group=sig.group,
        zero=sig.zero,
        perm=sig.perm,
        act=sig.activation,
        scale=sig.scale_dtype,
        out=sig.output,
        bias=sig.bias,
        float8=sig.family == "f8e4m3",
    )


FAMILIES: dict[str, tuple[Callable[[str, QuantType], LayoutPlan], Callable[[Signature, QuantType], Any]]] = {
    "affine": (plan_affine, key_of),
    "f8e4m3": (plan_affine, key_of),
    "mixprec": (mixprec_plan.plan, mixprec_plan.key_of),
}
"""Family -> (how the target stores its weights, the kernel key a consumer op needs)."""


def plan(name: str, t: QuantType) -> LayoutPlan:
    """How the triton target stores ``t`` (``FAMILIES``); a family no kernel decodes is a conversion."""
    entry = FAMILIES.get(t.family)
    if entry is None:
        return plan_affine(name, t)  # refuses it by name, as for any family the kernels do not decode
    return entry[0](name, t)


def container_tensors(m: Module) -> list[ContainerTensor]:
    """Every IR tensor with its bytes; logical codes a weight will be packed from count as packed."""
    packed: dict[str, ContainerTensor] = {}
    for op in m.ops():
        t = op.results[0].quant if op.name == "q.weight" else None
        p = plan("", t) if t is not None and t.pack.family == "logical" else None
        if t is None or p is None or p.kind != "exact" or p.pack is None:
            continue
        layout = find_layout(p.pack.family, p.pack.version)
        if layout is None:
            continue
        ref = str(op.attrs["codes"]).removeprefix("@")
        dtype, shape = layout.physical(dataclasses.replace(t, pack=p.pack))
        nbytes = dtype.bits * int(math.prod(shape)) // 8
        packed[ref] = ContainerTensor(ref, dtype.name, shape, nbytes, (ref,))
    return [
        packed.get(n) or ContainerTensor(n, d.blob.dtype.name, d.blob.shape, d.blob.nbytes, (n,))
        for n, d in m.tensors.items()
    ]


def op_keys(m: Module) -> Iterator[tuple[Op, Op, Any]]:
    """(consumer, its q.weight, the kernel key it needs) for every quantized linear / embedding."""
    for op, w, t in quantized_ops(m.graphs[0]):
        if op.name != "q.dequantize":
            yield op, w, FAMILIES[t.family][1](signature(op, t, "prefill", Place()), t)


def module_kernels(m: Module) -> dict[Any, list[str]]:
    """Every kernel key the module needs, with the weights that use it (sorted by id, deterministic)."""
    out: dict[Any, list[str]] = {}
    for _, w, key in op_keys(m):
        names = out.setdefault(key, [])
        if weight_name(w) not in names:
            names.append(weight_name(w))
    return dict(sorted(out.items(), key=lambda kv: kv[0].id))

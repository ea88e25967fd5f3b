"""What the ONNX targets hold exactly: format knowledge as tables.

- ``qdq``: ``DequantizeLinear(W [K, N], scale [K/B, N], zero?, axis=0, block_size=B) -> MatMul``;
  layout ``onnx-kn``; int4 or int8 codes.
- ``nbits``: ``com.microsoft.MatMulNBits(A, B, scales [N, K/B], zero_points?, bias?)``; layout
  ``ort-nbits``; 2, 4 or 8-bit codes.

A quantized embedding table stays ``[V, D]`` (``logical``) behind ``DequantizeLinear(axis=1) -> Gather``
in both forms. An act-order permutation ``perm`` (stored column ``j`` is original column ``perm[j]``)
of a weight only multiplied is held exactly: the input is gathered, ``x[..., perm] @ W_stored^T``
(``weights.py``). ``B`` is a power of two >= 16 (onnxruntime fuses and runs nothing else): the largest one
dividing the group size, so a per-channel weight (group = K = 384) is stored in blocks of 128 with its
scale repeated: the same values. Everything else is a conversion:

- scales other than f32 (``scale-dtype`` to f32, exact when widening f16);
- other families (nested K-quants, ternary), unsigned codes, other code widths, partial groups,
  exceptions, transforms, a permutation of a weight not only multiplied (``dense``);
- a weight both gathered and multiplied (a tied table) (``dense``).
"""

from __future__ import annotations

from qcompiler.backends.base import ContainerTensor, LayoutPlan, dense_plan, refused
from qcompiler.ir.core import Module
from qcompiler.ir.types import DenseType, PackSpec, QuantType

FORMS = {"qdq": "onnx-kn", "nbits": "ort-nbits"}
BITS = {"qdq": (4, 8), "nbits": (2, 4, 8)}
"""Code widths each form stores (QDQ int2 needs opset 25; MatMulNBits runs 2, 4 and 8 on CPU)."""
MIN_BLOCK = 16
LOGICAL = PackSpec("logical", 1, "none", (1, 1))


def block_size(group: int) -> int:
    """The largest power of two >= 16 dividing ``group`` (0 when there is none)."""
    b = group & -group
    return b if b >= MIN_BLOCK else 0


def group_of(t: QuantType) -> int:
    return t.group.size if t.group is not None else int(t.shape[1])


def plan(name: str, t: QuantType, form: str) -> LayoutPlan:
    """How form ``form`` stores ``t``: exactly in its layout, or through a conversion."""
    bits = t.code.dtype.bits
    group = group_of(t) if t.rank == 2 else 0
    checks: list[tuple[bool, str]] = [
        (t.family == "affine", f"ONNX quantized weights are affine integer codes, not family '{t.family}'"),
        (t.rank == 2, "a 2-D weight"),
        (t.req in ("linear", "embedding"), "a weight both gathered and multiplied (tied) has one ONNX orientation"),
        (t.code.dtype.signed, "signed codes (unsigned ones would need a zero-point rewrite)"),
        (bits in BITS[form], f"{form} stores {'/'.join(map(str, BITS[form]))}-bit codes, not {bits}"),
        (t.group is None or t.group.axis == 1, "groups along K"),
        (t.rank == 2 and int(t.shape[1]) % max(group, 1) == 0, "whole groups (K a multiple of the group size)"),
        (block_size(group) > 0, f"a power-of-two block >= {MIN_BLOCK} dividing the group size {group}"),
        (set(dict(t.qparams)) <= {"scale", "zero"}, "dense scale and optional zero point"),
        (t.perm is None or t.req == "linear", "a permutation only on a weight every use multiplies (x is gathered)"),
        (not t.exceptions and not t.transforms, "no exceptions or transforms"),
    ]
    no = refused(checks)
    if no is not None:
        return no
    scale = t.qparam("scale")
    if not isinstance(scale, DenseType) or any(not isinstance(q, DenseType) for _, q in t.qparams):
        return dense_plan("quantized qparams have no ONNX form")
    if scale.dtype.name != "f32":
        return LayoutPlan(
            "conversion", convert="scale-dtype", to="f32", reason=f"onnxruntime reads f32 scales, not {scale.dtype}"
        )
    if t.req == "embedding":
        return LayoutPlan("exact", pack=LOGICAL)
    if form == "nbits":
        return LayoutPlan("exact", pack=PackSpec("ort-nbits", 1, f"b{bits}", (1, block_size(group))))
    return LayoutPlan("exact", pack=PackSpec("onnx-kn", 1, "transpose", (1, 1)))


def container_tensors(m: Module) -> list[ContainerTensor]:
    """Every IR tensor with its bytes (the ONNX container is one model plus one data file)."""
    return [ContainerTensor(n, d.blob.dtype.name, d.blob.shape, d.blob.nbytes, (n,)) for n, d in m.tensors.items()]

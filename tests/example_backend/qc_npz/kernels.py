"""``npz.codes-linear``: a CPU ``q.linear`` kernel over the ``npz-codes`` layout, declared in the
package's ``KERNELS`` table. It keeps the codes as stored (int8, one per byte) with the float32 scale
and int zero point, and decodes the weight on each call (affine: ``(code - zero) * scale``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from qcompiler.ir.core import Module, Op
from qcompiler.ir.types import QuantType
from qcompiler.runtime.cpu_kernels import FLOATS, affine_parts
from qcompiler.runtime.kernels import KernelSpec, Place


def prepare(m: Module, op: Op, t: QuantType, place: Place) -> dict[str, Any]:
    codes, scale, zero, group = affine_parts(m, op, t)
    return {"codes": codes.to(torch.int8), "scale": scale, "zero": zero, "group": group}


def run(h: dict[str, Any], x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    codes, group = h["codes"], h["group"]
    k = codes.shape[1]
    diff = codes.float() if h["zero"] is None else codes - h["zero"].repeat_interleave(group, dim=1)[:, :k]
    w = diff.float() * h["scale"].repeat_interleave(group, dim=1)[:, :k]
    return F.linear(x, w.to(x.dtype), bias)


KERNELS = (
    KernelSpec(
        "npz.codes-linear",
        "q.linear",
        "packed",
        "cpu",
        families=frozenset({"affine"}),
        codes=frozenset({"i2", "i3", "i4", "i5", "i6", "i8"}),
        zero="any",
        scale_dtypes=FLOATS,
        groups=None,
        activations=FLOATS,
        outputs=FLOATS,
        layouts=frozenset({"npz-codes/v1"}),
        prepare=prepare,
        run=run,
    ),
)

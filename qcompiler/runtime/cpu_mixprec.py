"""``cpu.mixprec`` (packed): a ``mixprec`` weight (2/4-bit groups, nested scales, exclusive outliers)
on the CPU, never decoded to a dense float buffer.

Every group's codes fit 4 bits, so the dense part runs as torch's int4 tiles
(``_weight_int4pack_mm_for_cpu``): at load the planes are unpacked to codes ``[0, 15]`` and
repacked into its ISA-specific tiles (a 2-bit group's codes stay ``<= 3``: the map costs nothing at
run time), the second level is decoded once to the first-level scales ``s1`` (float32), and the
zero point goes in the float domain: the tiles compute ``(q - 8) * scale + offset``, so
``offset = (8 - zero) * s1`` gives ``(q - zero) * s1``. The outliers sit where the affine part is
exactly 0 (the family's rule), so replacement is an addition: ``y[:, r] += x[:, c] * v`` for each
outlier (one ``index_add`` over the CSR's expanded rows, float32). The repack widens the 2-bit groups
to 4 bits in memory: the kernel's loaded bytes are about 4.1 bits per weight plus the outliers, not
the stored rate.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from qcompiler.ir.attrs import SymbolRef
from qcompiler.ir.blobs import read_array, read_float32
from qcompiler.ir.core import Module, Op
from qcompiler.ir.layouts import logical_view
from qcompiler.ir.types import QuantType
from qcompiler.runtime.kernels import KernelSpec, Place


def _array(m: Module, ref: object) -> np.ndarray:
    assert isinstance(ref, SymbolRef)
    return read_array(m, ref.name)


def first_level_scales(m: Module, op: Op, t: QuantType) -> np.ndarray:
    """``s1`` float32 ``[N, K/G]``: the second level decoded (``float32(q_s - z2) * float32(s2)``), or
    the dense scale as stored."""
    ref = op.attrs["scale"]
    if not isinstance(ref, dict):
        assert isinstance(ref, SymbolRef)
        return read_float32(m, ref.name)  # bf16 bits widened, not cast
    sub = t.qparam("scale")
    assert isinstance(sub, QuantType)
    assert sub.group is not None
    codes = _array(m, ref["codes"]).astype(np.int32)
    rows = np.arange(codes.shape[0]) // sub.group.size
    zero = _array(m, ref["zero"]).astype(np.int32)[rows] if "zero" in ref else 0
    s2_ref = ref["scale"]
    assert isinstance(s2_ref, SymbolRef)
    s2 = read_float32(m, s2_ref.name)[rows]
    return (codes - zero).astype(np.float32) * s2


def prepare(m: Module, op: Op, t: QuantType, place: Place) -> dict[str, Any]:
    precision_map = {name: _array(m, op.attrs[name]) for name in ("wide", "wide_rows")}
    codes, _ = logical_view(_array(m, op.attrs["codes"]), t, precision_map)
    n, k = codes.shape
    assert t.group is not None
    s1 = torch.from_numpy(first_level_scales(m, op, t))
    zero = torch.from_numpy(_array(m, op.attrs["zero"]).astype(np.float32))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes.astype(np.int32)), 1)
    sz = torch.stack([s1.T, ((8.0 - zero) * s1).T], dim=-1).contiguous()
    rowptr = _array(m, op.attrs["rowptr"]).astype(np.int64)
    rows = torch.from_numpy(np.repeat(np.arange(n), np.diff(rowptr)))
    col = torch.from_numpy(_array(m, op.attrs["col"]).astype(np.int64))
    value = torch.from_numpy(_array(m, op.attrs["value"]).astype(np.float32))
    outliers = (rows, col, value) if value.numel() else None
    return {"packed": packed, "scale_zero": sz, "group": t.group.size, "k": k, "n": n, "outliers": outliers}


def run(h: dict[str, Any], x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x2 = x.reshape(-1, h["k"]).float()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, h["packed"], h["group"], h["scale_zero"])
    if h["outliers"] is not None:  # y[:, r] += x[:, c] * v for each outlier (r, c, v)
        rows, col, value = h["outliers"]
        y = y.index_add(1, rows, x2[:, col] * value)
    y = y.reshape([*x.shape[:-1], h["n"]]).to(x.dtype)
    return y if bias is None else y + bias


KERNEL = KernelSpec(
    "cpu.mixprec",
    "q.linear",
    "packed",
    "cpu",
    families=frozenset({"mixprec"}),
    codes=frozenset({"u4"}),
    zero="any",
    scale_dtypes=frozenset({"quantized", "f32", "f16", "bf16"}),
    groups=frozenset({32, 64, 128, 256}),
    activations=frozenset({"f32"}),
    outputs=frozenset({"f32"}),
    n_multiple=16,
    layouts=frozenset({"mixprec/v1", "logical/v1"}),
    repack=(
        "planes unpacked to codes [0, 15] into torch's int4 tiles (2-bit groups widened to 4 bits); second "
        "level decoded to float32 s1; (8 - zero) * s1 as the offset; outliers (row, col, float32 value) added"
    ),
    error_bound=1e-5,
    prepare=prepare,
    run=run,
)

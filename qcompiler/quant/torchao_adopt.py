"""Adopt torchao-quantized weights: read codes, scales, zero points and block size from the tensor
subclass as they are, and swap in ``QuantLinear``/``QuantEmbedding`` so export shows one
``qcompiler::dequantize_affine`` per weight. torchao's own ``dequantize()`` is kept as the effective
weight ``freeze-semantics`` must reproduce.

Readable subclasses:

- ``IntxUnpackedToInt8Tensor`` (``IntxWeightOnlyConfig``, ``Int8DynamicActivationIntxWeightConfig``):
  ``qdata`` i8 ``[N, K]``, ``scale`` and ``zero_point`` ``[N, K/G]``, code range from ``target_dtype``;
- ``Int8Tensor`` (``Int8WeightOnlyConfig``): ``qdata`` i8 ``[N, K]``, ``scale`` ``[N, 1]``, int8 range.

Other subclasses (e.g. ``Int4OpaqueTensor``) keep codes in an ISA-specific packed layout and are
refused with the module named.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from qcompiler.errors import QcError
from qcompiler.quant.modules import QuantEmbedding, QuantLinear, swap_module
from qcompiler.quant.rtn import AffineQuant

READABLE = ("IntxUnpackedToInt8Tensor", "Int8Tensor")


class AdoptError(QcError):
    """A torchao weight whose codes cannot be read as they are."""


def code_range(w: Any) -> tuple[int, int]:
    target = getattr(w, "target_dtype", torch.int8)
    m = re.fullmatch(r"torch\.int(\d)", str(target))
    bits = int(m.group(1)) if m else 8
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def is_torchao(w: Any) -> bool:
    return isinstance(w, torch.Tensor) and type(w).__module__.startswith("torchao")


def adopt_torchao(model: nn.Module) -> dict[str, torch.Tensor]:
    """Swap every torchao-quantized ``Linear``/``Embedding`` weight for frozen qcompiler modules.

    Returns ``{weight name: torchao's dequantized weight}`` for ``capture(..., effective=...)``.
    """
    effective: dict[str, torch.Tensor] = {}
    for fqn, mod in list(model.named_modules()):
        w: Any = getattr(mod, "weight", None)
        if not is_torchao(w):
            continue
        kind = type(w).__name__
        if kind not in READABLE:
            raise AdoptError(
                f"{fqn}.weight: torchao {kind} keeps its codes in a packed, ISA-specific layout; "
                f"use IntxWeightOnlyConfig or Int8WeightOnlyConfig (readable: {', '.join(READABLE)})"
            )
        qmin, qmax = code_range(w)
        block = [int(b) for b in w.block_size]
        n, k = w.qdata.shape
        groups = -(-k // block[-1])
        zero = w.zero_point.reshape(n, groups) if getattr(w, "zero_point", None) is not None else None
        q = AffineQuant(
            codes=w.qdata, scale=w.scale.reshape(n, groups), zero=zero, qmin=qmin, qmax=qmax, group=block[-1]
        )
        source = {"kind": "torchao", "type": kind}
        with torch.no_grad():
            effective[f"{fqn}.weight"] = w.dequantize().detach().clone()
        if isinstance(mod, nn.Linear):
            swap_module(model, fqn, QuantLinear(q, mod.bias, w.dtype, source))
        elif isinstance(mod, nn.Embedding):
            swap_module(model, fqn, QuantEmbedding(q, mod.padding_idx, w.dtype, source))
        else:
            raise AdoptError(f"{fqn}: torchao weight on a {type(mod).__name__}, which has no quantized counterpart")
    return effective

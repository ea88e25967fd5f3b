"""``mixed-2416``: the built-in intra-weight mixed 2/4/16-bit scheme as a quantized module and the one
custom op through which it exports (``qcompiler::dequantize_mixprec``).

Scheme spelling (parts after ``mixed-2416``, each optional, any order)::

    mixed-2416[-g<G>][-s<G2>][-r<RATE>][-o<OUTLIERS>][-layers]

``g``: first-level group size along K (default 64); ``s``: second-level group size along N
(default 64); ``r``: the all-in target rate in bits/weight, codes + qparams + exceptions (default
3.0); ``o``: the outlier fraction (default the quantizer's); ``layers``: the layer-level baseline
(each whole weight 2-bit or 4-bit at the same total rate, no outliers) instead of the intra-weight
allocation. ``mixed-2416-g128-r2.8`` is groups of 128 at 2.8 bits. The rate is met over all the
quantized weights of the model together. Without calibration text, by the per-group error model
(``allocate_mixed``): sensitive weights get more 4-bit groups. With it (``quant/calibration.py``),
by measurement (``mixprec_search.allocate_measured``): from the layer-level allocation, each
weight's row options scored by the model's output change on the worst quarter of the texts,
then one exact knapsack.

The module's forward computes ``F.linear(x, dequantize_mixprec(...), bias)``; the op is the source's
own dequantize that ``freeze-semantics`` proves the reference decoder reproduces bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from qcompiler.quant.calibration import calibrated, hessians_for, importance_for, swapped_losses
from qcompiler.quant.conv1d import as_linear, is_linear, linear_weight
from qcompiler.quant.mixprec import MixedQuant
from qcompiler.quant.mixprec_alloc import DEFAULT_OUTLIERS, Budget, allocate_layers, allocate_mixed, quantize_mixed
from qcompiler.quant.mixprec_search import allocate_measured
from qcompiler.quant.schemes import SchemeError

PREFIX = "mixed-2416"
STREAMS = ("codes", "zero", "scale_codes", "scale2", "zero2", "wide", "wide_rows", "rowptr", "col", "value")
"""The arrays of one weight, in the op's operand order."""


@torch.library.custom_op("qcompiler::dequantize_mixprec", mutates_args=())
def dequantize_mixprec(
    codes: torch.Tensor,
    zero: torch.Tensor,
    scale_codes: torch.Tensor,
    scale2: torch.Tensor,
    zero2: torch.Tensor,
    wide: torch.Tensor,
    wide_rows: torch.Tensor,
    rowptr: torch.Tensor,
    col: torch.Tensor,
    value: torch.Tensor,
    group: int,
    group2: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``s1 = (scale_codes - zero2) * scale2`` (second level, rows in groups of ``group2``), then
    ``(codes - zero) * s1`` per group of ``group`` along K, then ``w[r, col] = value``; float32 steps,
    cast to ``out_dtype``. ``wide`` and ``wide_rows`` (the 4-bit groups, rows) are carried for the
    frontend; the codes hold every bit the decode needs."""
    n, k = codes.shape
    rows = torch.arange(n) // group2
    s1 = (scale_codes.to(torch.float32) - zero2[rows].to(torch.float32)) * scale2[rows].to(torch.float32)
    diff = codes.to(torch.float32).reshape(n, k // group, group) - zero.to(torch.float32).unsqueeze(-1)
    w = (diff * s1.unsqueeze(-1)).reshape(n, k)
    owner = torch.repeat_interleave(torch.arange(n), torch.diff(rowptr.to(torch.int64)))
    w[owner, col.to(torch.int64)] = value.to(torch.float32)
    return w.to(out_dtype)


@dequantize_mixprec.register_fake
def _(
    codes: torch.Tensor,
    zero: torch.Tensor,
    scale_codes: torch.Tensor,
    scale2: torch.Tensor,
    zero2: torch.Tensor,
    wide: torch.Tensor,
    wide_rows: torch.Tensor,
    rowptr: torch.Tensor,
    col: torch.Tensor,
    value: torch.Tensor,
    group: int,
    group2: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return torch.empty(codes.shape, dtype=out_dtype, device=codes.device)


class MixprecLinear(nn.Module):
    """An ``nn.Linear`` whose weight is one ``MixedQuant`` (frozen buffers)."""

    def __init__(self, q: MixedQuant, bias: torch.Tensor | None, out_dtype: torch.dtype, source: str) -> None:
        super().__init__()
        for name in STREAMS:
            self.register_buffer(name, torch.from_numpy(np.ascontiguousarray(getattr(q, name))))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.group, self.group2, self.out_dtype = q.group, q.group2, out_dtype
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.source = source

    def dequantized_weight(self) -> torch.Tensor:
        parts = [self.get_buffer(name) for name in STREAMS]
        return torch.ops.qcompiler.dequantize_mixprec(*parts, self.group, self.group2, self.out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dequantized_weight()
        return F.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


@dataclass(frozen=True)
class MixScheme:
    """A parsed ``mixed-2416`` spelling (see the module docstring)."""

    group: int = 64
    group2: int = 64
    rate: float = 3.0
    outliers: float = DEFAULT_OUTLIERS
    layers: bool = False


OPTION = re.compile(r"(g|s|r|o)([0-9]+(?:\.[0-9]+)?)|(layers)")


def parse_mixed(text: str) -> MixScheme:
    """``mixed-2416-g128-r2.8`` -> ``MixScheme(group=128, rate=2.8)``; a ``SchemeError`` names the bad part."""
    if text != PREFIX and not text.startswith(PREFIX + "-"):
        raise SchemeError(f"invalid quantization scheme {text!r}: not a {PREFIX} scheme")
    fields: dict[str, float] = {}
    layers = False
    for part in text.removeprefix(PREFIX).split("-")[1:]:
        m = OPTION.fullmatch(part)
        if m is None:
            raise SchemeError(
                f"invalid quantization scheme {text!r}: unknown part {part!r}; expected "
                f"{PREFIX}[-g<G>][-s<G2>][-r<bits>][-o<fraction>][-layers], e.g. {PREFIX}-g64-r3.0"
            )
        if m.group(3):
            layers = True
        else:
            fields[m.group(1)] = float(m.group(2))
    s = MixScheme(
        int(fields.get("g", 64)),
        int(fields.get("s", 64)),
        fields.get("r", 3.0),
        fields.get("o", DEFAULT_OUTLIERS),
        layers,
    )
    if s.group < 16 or s.group % 16 or s.group2 < 1 or not 2.0 <= s.rate <= 8.0 or not 0 <= s.outliers < 0.5:
        raise SchemeError(
            f"invalid quantization scheme {text!r}: the group is a multiple of 16, the second-level group "
            f"positive, the rate in [2, 8] bits and the outlier fraction in [0, 0.5) (found {s})"
        )
    return s


def targets(model: nn.Module, exclude: tuple[str, ...], only: Collection[str] | None) -> dict[str, nn.Module]:
    out: dict[str, nn.Module] = {}
    for fqn, mod in model.named_modules():
        if not is_linear(mod) or any(fqn == e or fqn.endswith("." + e) for e in exclude):
            continue
        if only is None or fqn in only:
            out[fqn] = mod
    return out


class MixedProvider:
    """The ``mixed-2416`` scheme through ``qcompiler.quant.registry``: a module scheme that quantizes the
    whole model at once (the rate is met over all its weights; calibration runs the float model), so
    it is never streamed."""

    described = "intra-weight mixed 2/4/16-bit"
    streamable = False

    def scheme(self, name: str) -> None:
        parse_mixed(name)

    def plan(
        self, model: nn.Module, name: str, exclude: tuple[str, ...], embeddings: bool, only: Collection[str] | None
    ) -> dict[str, str]:
        parse_mixed(name)
        return dict.fromkeys(targets(model, exclude, only), name)

    def quantize(
        self, model: nn.Module, name: str, exclude: tuple[str, ...], embeddings: bool, only: Collection[str] | None
    ) -> nn.Module:
        s = parse_mixed(name)
        mods = targets(model, exclude, only)
        weights = {fqn: linear_weight(mod).detach().clone() for fqn, mod in mods.items()}

        def two_bit(fqn: str) -> tuple[torch.Tensor, float]:
            h = None if hessians is None else hessians[fqn]
            diag = None if h is None else (torch.diagonal(h) if h.dim() == 2 else h)
            q = quantize_mixed(weights[fqn], group=s.group, group2=s.group2, budget=Budget(0, 0), hessian=diag)
            dq = torch.from_numpy(q.decode())
            err = ((dq.double() - weights[fqn].double()) ** 2) * (1.0 if diag is None else diag)
            return dq, float(err.sum())

        run = calibrated(model)
        hessians = None if run is None else hessians_for(model, list(mods), run)
        importance = None if run is None or hessians is None else importance_for(model, run, weights, two_bit)
        if s.layers or run is None or hessians is None:
            quants = (
                allocate_layers(
                    weights,
                    s.rate,
                    group=s.group,
                    group2=s.group2,
                    hessians=hessians,
                    importance=importance,
                    stored=True,
                )
                if s.layers
                else allocate_mixed(
                    weights,
                    s.rate,
                    group=s.group,
                    group2=s.group2,
                    outliers=s.outliers,
                    hessians=hessians,
                    importance=importance,
                )
            )
        else:  # measured: from the layer-level allocation, each weight's row options on the calibration text
            start = allocate_layers(
                weights, s.rate, group=s.group, group2=s.group2, hessians=hessians, importance=importance, stored=True
            )
            calib = run
            quants = allocate_measured(
                weights,
                s.rate,
                hessians=hessians,
                context={fqn: torch.from_numpy(q.decode()) for fqn, q in start.items()},
                measure=lambda decodes: swapped_losses(model, calib, decodes, weights),
                group=s.group,
                group2=s.group2,
                outliers=s.outliers,
            )
        for fqn, mod in mods.items():
            lin = as_linear(mod)
            assert isinstance(lin, nn.Linear)
            new = MixprecLinear(quants[fqn], lin.bias, weights[fqn].dtype, f"qcompiler.quantize({name})")
            parent, _, child = fqn.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
        return model

    def module(self, mod: nn.Module, name: str) -> nn.Module:
        raise SchemeError(f"{name} quantizes the whole model at once; it is not streamed module by module")


PROVIDER = MixedProvider()

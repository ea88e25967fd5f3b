"""Round-to-nearest (RTN) affine weight quantization.

A weight ``w`` of shape ``[N, K]`` is cut into groups of ``G`` consecutive elements along K (the
last group may be short: ``K = 70, G = 32`` gives groups of 32, 32 and 6; nothing is padded). Each
group gets a float32 ``scale`` (and, when asymmetric, a signed ``zero`` point):

- symmetric: ``scale = amax(|w_g|) / ((qmax - qmin) / 2)``, ``code = clamp(round(w / scale), qmin, qmax)``;
- asymmetric: ``lo = min(min(w_g), 0)``, ``hi = max(max(w_g), 0)``, ``scale = (hi - lo) / (qmax - qmin)``,
  ``zero = clamp(qmin - round(lo / scale), qmin, qmax)``,
  ``code = clamp(round(w / scale) + zero, qmin, qmax)``.

Everything is computed in float32 with ``torch.round`` (round half to even), vectorised over all
groups. A group whose scale would be zero or subnormal (all-zero weights) gets ``scale = 2**-20``,
so every code there is 0 (the zero point, when asymmetric) and it decodes to exactly 0.

The decode formula (family ``affine``, decoder version 1) is the semantic contract everywhere::

    x[n, k] = float32(code[n, k] - zero[n, k // G]) * float32(scale[n, k // G])

one float32 multiply of exact operands (``zero = 0`` when symmetric), then a cast to the expressed
dtype. ``AffineQuant.dequantize`` computes it; ``qcompiler.ir.reference`` is its slow oracle. A
weight read from an act-order (GPTQ ``desc_act``) checkpoint names the group of each input column
instead (``g_idx``, int32 ``[K]``): ``k // G`` above becomes ``g_idx[k]``. The quantizer here never
makes one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qcompiler.errors import QcError
from qcompiler.quant.schemes import Scheme

EMPTY_GROUP_SCALE = 2.0**-20
"""Scale of a group whose weights are all zero (or so small their scale would be subnormal)."""


class QuantizeError(QcError):
    """A weight cannot be quantized (not 2-D float, non-finite values, a range too large for float32)."""


@dataclass(frozen=True, eq=False)
class AffineQuant:
    """A weight quantized to affine codes with per-group qparams (compared by identity: tensors inside).

    ``codes``: int8 ``[N, K]`` in ``[qmin, qmax]``; ``scale``: float32 ``[N, ceil(K / group)]``;
    ``zero``: int8 of the same shape, or ``None`` when symmetric; ``group``: the group size along K
    (``== K`` for per-channel); ``g_idx``: int32 ``[K]``, the group of each input column of an
    act-order checkpoint (``None``: ``k // group``). Decodes with ``dequantize()``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    qmin: int
    qmax: int
    group: int
    g_idx: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's shape ``(N, K)``."""
        n, k = self.codes.shape
        return int(n), int(k)

    @property
    def symmetric(self) -> bool:
        """Whether there is no zero point."""
        return self.zero is None

    def dequantize(self) -> torch.Tensor:
        """``float32(code - zero[g]) * float32(scale[g])`` with ``g = g_idx[k]`` (else ``k // group``),
        as float32 ``[N, K]``."""
        k = self.codes.shape[1]
        group_of = torch.arange(k, device=self.codes.device) // self.group
        if self.g_idx is not None:
            group_of = self.g_idx.to(device=self.codes.device, dtype=torch.int64)
        diff = self.codes.to(torch.int32)
        if self.zero is not None:
            diff = diff - self.zero.to(torch.int32).index_select(1, group_of)
        scale = self.scale.to(torch.float32).index_select(1, group_of)
        return diff.to(torch.float32) * scale


def quantize_weight(w: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype = torch.float32) -> AffineQuant:
    """Quantize a float ``[N, K]`` weight with round-to-nearest under ``scheme``; scales are stored in
    ``scale_dtype`` (the model's dtype for a bf16/fp16 model, as compressed-tensors writes them) and
    the codes are rounded against the stored scales, so the decode is exact in that dtype.

    Rows are independent (groups lie along K), so the work goes ``BLOCK_ELEMENTS`` at a time: the
    float32 temporaries stay a few MB (cache- and heap-sized) whatever the weight, with the same
    codes and scales as one whole-tensor pass.

    Raises ``QuantizeError`` for a tensor that is not 2-D float, holds a non-finite value (naming
    its index) or whose group range overflows float32.
    """
    _check_shape(w)
    if scheme.rounding is not None:  # a backend's scheme: its provider rounds (quant/registry.py)
        from qcompiler.quant.registry import provider

        declared = provider(scheme.rounding)
        if declared is None:
            raise QuantizeError(f"scheme {scheme.rounding!r}: no backend declares it")
        _check_finite(w.detach().to(torch.float32), 0)
        return declared.round(w, scheme)
    n, k = int(w.shape[0]), int(w.shape[1])
    group = k if scheme.group is None else scheme.group
    n_groups = -(-k // group)
    ratios = CLIP_RATIOS if scheme.clip else (1.0,)
    codes = torch.empty((n, k), dtype=torch.int8)
    scale = torch.empty((n, n_groups), dtype=scale_dtype)
    zero = None if scheme.symmetric else torch.empty((n, n_groups), dtype=torch.int8)
    step = max(1, BLOCK_ELEMENTS // (len(ratios) * n_groups * group))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        c, sc, z = _quantize_rows(w[r0:r1].detach().to(torch.float32), scheme, ratios, group, scale_dtype, r0)
        codes[r0:r1], scale[r0:r1] = c, sc
        if zero is not None and z is not None:
            zero[r0:r1] = z
    return AffineQuant(codes=codes, scale=scale, zero=zero, qmin=scheme.qmin, qmax=scheme.qmax, group=group)


BLOCK_ELEMENTS = 1 << 20
"""Weight elements (times the clipping search's candidate count) quantized at a time."""


def _quantize_rows(
    w32: torch.Tensor, scheme: Scheme, ratios: tuple[float, ...], group: int, scale_dtype: torch.dtype, row0: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes, scales and zero points of float32 rows ``row0 + [0, len(w32))`` of a weight."""
    _check_finite(w32, row0)
    n, k = int(w32.shape[0]), int(w32.shape[1])
    n_groups = -(-k // group)
    # Zero padding to whole groups changes no statistic: |0| <= amax, and lo <= 0 <= hi anyway.
    pad = n_groups * group - k
    padded = (torch.nn.functional.pad(w32, (0, pad)) if pad else w32).reshape(n, n_groups, group)
    grids = [_grid(padded, scheme, r, scale_dtype, row0) for r in ratios]
    scale, zero, codes = grids[0]
    if len(grids) > 1:
        # clipping search: per group, the shrunk range whose round trip has the least squared error
        errors = torch.stack([_sq_error(padded, g) for g in grids])
        best = errors.argmin(dim=0)
        scale = torch.stack([g[0] for g in grids]).gather(0, best.unsqueeze(0))[0]
        if not scheme.symmetric:
            zero = torch.stack([g[1] for g in grids if g[1] is not None]).gather(0, best.unsqueeze(0))[0]
        all_codes = torch.stack([g[2] for g in grids])
        codes = all_codes.gather(0, best.unsqueeze(0).unsqueeze(-1).expand(1, n, n_groups, group))[0]
    codes = codes.reshape(n, n_groups * group)[:, :k]
    return codes.to(torch.int8), scale.to(scale_dtype), None if zero is None else zero.to(torch.int8)


CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(11))
"""Fractions of each group's range tried by the clipping search (``-clip`` schemes): 1.0 down to 0.5."""


def _grid(
    padded: torch.Tensor, scheme: Scheme, ratio: float, scale_dtype: torch.dtype = torch.float32, row0: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Scale (float32 values representable in ``scale_dtype``), zero point and codes for every group
    with its range shrunk to ``ratio``."""
    qmin, qmax = scheme.qmin, scheme.qmax
    if scheme.symmetric:
        amax = torch.maximum(padded.amax(dim=2), -padded.amin(dim=2))  # amax(|w|) without an |w| copy
        scale = _stored(_guard(amax * ratio / ((qmax - qmin) / 2)), scale_dtype, row0)
        zero = None
    else:
        lo = padded.amin(dim=2).clamp(max=0.0) * ratio
        hi = padded.amax(dim=2).clamp(min=0.0) * ratio
        scale = _stored(_guard((hi - lo) / float(qmax - qmin)), scale_dtype, row0)
        zero = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax)
    _check_scale(scale, row0)
    codes = torch.div(padded, scale.unsqueeze(2)).round_()  # in place from here: one temporary
    if zero is not None:
        codes.add_(zero.unsqueeze(2))
    return scale, zero, codes.clamp_(qmin, qmax)


def _sq_error(padded: torch.Tensor, grid: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]) -> torch.Tensor:
    scale, zero, codes = grid
    diff = codes if zero is None else codes - zero.unsqueeze(2)
    return ((diff * scale.unsqueeze(2) - padded) ** 2).sum(dim=2)


def _stored(scale: torch.Tensor, dtype: torch.dtype, row0: int = 0) -> torch.Tensor:
    """``scale`` rounded to ``dtype`` (and back to float32 for the arithmetic); a scale that rounds to
    zero or overflows there is an error naming the group, never a silently wrong code."""
    if dtype == torch.float32:
        return scale
    stored = scale.to(dtype).to(torch.float32)
    bad = torch.nonzero((stored <= 0) | ~torch.isfinite(stored))
    if bad.shape[0] > 0:
        n, g = (int(i) for i in bad[0])
        raise QuantizeError(
            f"weight row {row0 + n}, group {g}: scale {float(scale[n, g]):.3e} is not representable in {dtype} "
            "(quantize the float32 model instead)"
        )
    return stored


def _guard(scale: torch.Tensor) -> torch.Tensor:
    """Replace zero and subnormal scales (all-zero groups) by ``EMPTY_GROUP_SCALE``."""
    tiny = torch.finfo(torch.float32).tiny
    return torch.where(scale < tiny, torch.full_like(scale, EMPTY_GROUP_SCALE), scale)


def _check_shape(w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise QuantizeError(f"weight must be 2-D [N, K] (found shape {list(w.shape)})")
    if not w.dtype.is_floating_point:
        raise QuantizeError(f"weight must be a float tensor (found {w.dtype})")
    if w.shape[0] == 0 or w.shape[1] == 0:
        raise QuantizeError(f"weight must not be empty (found shape {list(w.shape)})")


def _check_finite(w32: torch.Tensor, row0: int) -> None:
    """Every value of float32 rows ``row0 + [0, len(w32))`` finite, or an error naming the first that is not."""
    if bool(torch.isfinite(w32.sum())):  # NaN and inf reach the sum: far cheaper than isfinite(w32)
        return
    bad = torch.nonzero(~torch.isfinite(w32))  # the sum may also overflow on finite values: look
    if bad.shape[0] > 0:
        n, k = (int(i) for i in bad[0])
        raise QuantizeError(f"weight[{row0 + n}, {k}] is not finite (found {float(w32[n, k])}); cannot quantize")


def _check_scale(scale: torch.Tensor, row0: int = 0) -> None:
    bad = torch.nonzero(~torch.isfinite(scale))
    if bad.shape[0] > 0:
        n, g = (int(i) for i in bad[0])
        raise QuantizeError(f"weight row {row0 + n}, group {g}: range overflows float32 (scale {float(scale[n, g])})")

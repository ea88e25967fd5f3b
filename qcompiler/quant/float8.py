"""FP8 weights: a Linear whose frozen codes are float8 E4M3 bit patterns, and the op it exports through.

A compressed-tensors ``float-quantized`` checkpoint (llmcompressor's ``FP8``/``FP8_DYNAMIC``
schemes) stores each weight as ``float8_e4m3fn`` values and a scale per output channel, per tensor
or per group. ``Float8Linear`` holds those bytes as ``uint8`` codes (the bit patterns, unchanged)
and calls ``qcompiler::dequantize_f8e4m3``, which ``torch.export`` keeps as one node with constant
operands; the frontend lowers it to a ``q.source_weight`` of family ``f8e4m3``. The decode is
``float32(e4m3fn(code)) * float32(scale[g])``, the same multiply the reference decoder makes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


@torch.library.custom_op("qcompiler::dequantize_f8e4m3", mutates_args=())
def dequantize_f8e4m3(codes: torch.Tensor, scale: torch.Tensor, group: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``e4m3fn(codes) * scale`` in float32, the scale repeated over groups of ``group`` along the last
    axis (``scale`` of one element: per tensor), cast to ``out_dtype``. ``codes`` are uint8 bit patterns."""
    values = codes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    s = scale.to(torch.float32)
    if s.numel() != 1:
        s = s.repeat_interleave(group, dim=-1)[..., : codes.shape[-1]]
    return (values * s).to(out_dtype)


@dequantize_f8e4m3.register_fake
def _(codes: torch.Tensor, scale: torch.Tensor, group: int, out_dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(codes.shape, dtype=out_dtype, device=codes.device)


class Float8Linear(nn.Module):
    """``y = x @ dequantize_f8e4m3(codes, scale).T + bias`` with frozen float8 codes."""

    decode_op = "dequantize_f8e4m3"

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        group: int,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
        source: dict[str, Any],
    ) -> None:
        super().__init__()
        if codes.dtype != torch.uint8 or codes.dim() != 2:
            raise TypeError(
                f"float8 codes must be uint8 [out, in] bit patterns, found {codes.dtype}{list(codes.shape)}"
            )
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scale", scale.contiguous())
        self.group, self.out_dtype, self.source = group, out_dtype, source
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.out_features, self.in_features = (int(d) for d in codes.shape)

    def dequantized_weight(self) -> torch.Tensor:
        return torch.ops.qcompiler.dequantize_f8e4m3(
            self.get_buffer("codes"), self.get_buffer("scale"), self.group, self.out_dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantized_weight(), self.bias)

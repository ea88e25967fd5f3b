"""Weights quantized in llama.cpp's K-quant formats (``--scheme q4_k | q5_k | q6_k``), and what they mean
as QIR descriptors.

``quantize`` replaces each ``nn.Linear`` by a ``GgmlLinear`` holding the block bytes ggml's reference
quantizer writes (byte-identical to llama.cpp's C code). Its forward calls
``qcompiler::dequantize_ggml``, which ``torch.export`` keeps as one node with a constant operand; the
frontend lowers it to ``q.source_blocks`` and ``freeze-semantics`` turns it into a descriptor with
*nested* qparams (a K-quant's sub-block scales are themselves quantized against a super-block scale):

| format | codes, groups | ``scale`` (and ``min``) slots |
|---|---|---|
| Q4_K / Q5_K | ``u4``/``u5``, 32 | ``affine`` ``u6`` codes, 8 per f16 ``d`` / ``dmin`` (one per 256) |
| Q6_K | ``i6``, 16 | ``affine`` ``i8`` codes, 16 per f16 ``d`` (one per 256) |
| Q4_1 / Q5_1 | ``u4``/``u5``, 32 | dense f16 ``scale`` = ``d`` and ``min`` = ``-m`` |

Each is a ``nested`` descriptor, except TQ2_0 and TQ1_0: ``ternary`` codes {-1, 0, 1} in groups of 256 with an
f16 scale (``x = code * d``).

``x = scale * code - min`` in float32, with ``scale = sub_scale * d`` and ``min = sub_min * dmin``:
exactly ggml's ``dequantize_row_q4_K`` arithmetic.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import nn

from qcompiler.backends.gguf.codecs import get_codec
from qcompiler.backends.gguf.ggml_types import GGMLType
from qcompiler.frontend.skeleton import is_fake
from qcompiler.ir.dtypes import DTYPES, DType, code_dtype
from qcompiler.ir.types import Alphabet, CodeContract, DenseType, GroupSpec, QuantType

K_SCHEMES = {
    "q4_k": "Q4_K",
    "q5_k": "Q5_K",
    "q6_k": "Q6_K",
    "q4_1": "Q4_1",
    "q5_1": "Q5_1",
    "tq2_0": "TQ2_0",
    "tq1_0": "TQ1_0",
}
"""``--scheme`` spelling -> ggml type name."""
Binding = dict[str, Any]


def codec_of(fmt: str) -> Any:
    return get_codec(GGMLType[fmt])


@torch.library.custom_op("qcompiler::dequantize_ggml", mutates_args=())
def dequantize_ggml(blocks: torch.Tensor, fmt: str, n: int, out_dtype: torch.dtype) -> torch.Tensor:
    """ggml's dequantize of ``blocks`` (``u8[rows, row_bytes]``) of format ``fmt``: float32, then ``out_dtype``."""
    return torch.from_numpy(codec_of(fmt).dequantize(blocks.numpy())).to(out_dtype)


@dequantize_ggml.register_fake
def _(blocks: torch.Tensor, fmt: str, n: int, out_dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((blocks.shape[0], n), dtype=out_dtype, device=blocks.device)


class GgmlLinear(nn.Module):
    """A Linear whose weight is held as ggml blocks (see the module docstring)."""

    def __init__(self, blocks: np.ndarray, fmt: str, n: int, bias: torch.Tensor | None, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("blocks", torch.from_numpy(np.ascontiguousarray(blocks)))
        self.fmt, self.n, self.out_dtype = fmt, n, out_dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.source = {"kind": "qcompiler.quantize", "scheme": fmt.lower()}

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_ggml(self.get_buffer("blocks"), self.fmt, self.n, self.out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantized_weight(), self.bias)

    def twin_for(self, mod: nn.Module) -> nn.Module:
        """``mod`` (tied to this weight) reading these same blocks (``quant.modules.tied_twin``)."""
        return twin(self, mod)


class GgmlEmbedding(nn.Module):
    """An Embedding whose table is held as ggml blocks."""

    def __init__(self, blocks: np.ndarray, fmt: str, n: int, padding_idx: int | None, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("blocks", torch.from_numpy(np.ascontiguousarray(blocks)))
        self.fmt, self.n, self.padding_idx, self.out_dtype = fmt, n, padding_idx, out_dtype
        self.source = {"kind": "qcompiler.quantize", "scheme": fmt.lower()}

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_ggml(self.get_buffer("blocks"), self.fmt, self.n, self.out_dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.dequantized_weight(), self.padding_idx)

    def twin_for(self, mod: nn.Module) -> nn.Module:
        """``mod`` (tied to this table) reading these same blocks (``quant.modules.tied_twin``)."""
        return twin(self, mod)


def twin(table: GgmlLinear | GgmlEmbedding, mod: nn.Module) -> nn.Module:
    blocks = table.get_buffer("blocks")
    held = np.zeros(tuple(blocks.shape), dtype=np.uint8) if is_fake(blocks) else blocks.numpy()  # replaced below
    made: nn.Module = (
        GgmlLinear(held, table.fmt, table.n, None, table.out_dtype)
        if isinstance(mod, nn.Linear)
        else GgmlEmbedding(held, table.fmt, table.n, getattr(mod, "padding_idx", None), table.out_dtype)
    )
    made.register_buffer("blocks", blocks)
    made.source = table.source  # type: ignore[assignment]
    return made


ROWS_AT_ONCE = 1 << 23
"""Elements of a weight widened to float32 at a time by ``quantize_rows``."""


def quantize_rows(fmt: str, w: torch.Tensor) -> np.ndarray:
    """``codec.quantize`` of ``w``'s rows, about ``ROWS_AT_ONCE`` elements at a time (ggml blocks lie
    within a row, so the bytes are the ones a single call gives): a bf16 weight is never held in
    float32 whole."""
    codec = codec_of(fmt)
    n, k = int(w.shape[0]), int(w.shape[1])
    step = max(1, ROWS_AT_ONCE // max(1, k))
    if n <= step:
        return codec.quantize(w.to(torch.float32).numpy())
    first = codec.quantize(w[:step].to(torch.float32).numpy())
    out = np.empty((n, first.shape[1]), dtype=first.dtype)
    out[:step] = first
    for start in range(step, n, step):
        out[start : start + step] = codec.quantize(w[start : start + step].to(torch.float32).numpy())
    return out


def ggml_linear(mod: nn.Linear, scheme: str) -> GgmlLinear:
    fmt = K_SCHEMES[scheme]
    w = mod.weight.detach()
    blocks = quantize_rows(fmt, w)
    return GgmlLinear(blocks, fmt, int(w.shape[1]), mod.bias, w.dtype)


def ggml_embedding(mod: nn.Embedding, scheme: str) -> GgmlEmbedding:
    fmt = K_SCHEMES[scheme]
    w = mod.weight.detach()
    blocks = quantize_rows(fmt, w)
    return GgmlEmbedding(blocks, fmt, int(w.shape[1]), mod.padding_idx, w.dtype)


def _code(name: str) -> CodeContract:
    c = code_dtype(name)
    assert c is not None
    return CodeContract(c, Alphabet(c.min, c.max))


def _sub(codes: str, rows: int, groups: int, per: int, supers: int) -> QuantType:
    """A sub-block qparam: integer codes against one f16 super-block scale per ``per`` of them."""
    f32, f16 = DTYPES["f32"], DTYPES["f16"]
    return QuantType(
        "affine",
        _code(codes),
        DenseType(f32, (rows, groups)),
        GroupSpec(1, per),
        (("scale", DenseType(f16, (rows, supers))),),
        req="qparam",
    )


def describe_blocks(fmt: str, parts: dict[str, np.ndarray], expressed: DType) -> tuple[QuantType, Binding]:
    """The descriptor of a K-quant weight and its arrays (nested dicts for nested qparams)."""
    n, k = parts["codes"].shape
    supers = k // 256
    if fmt in ("Q4_K", "Q5_K"):
        bits = 4 if fmt == "Q4_K" else 5
        sub = _sub("u6", n, k // 32, 8, supers)
        t = QuantType(
            "nested", _code(f"u{bits}"), DenseType(expressed, (n, k)), GroupSpec(1, 32), (("scale", sub), ("min", sub))
        )
        return t, {
            "codes": parts["codes"],
            "scale": {"codes": parts["sub_scale"], "scale": parts["d"]},
            "min": {"codes": parts["sub_min"], "scale": parts["dmin"]},
        }
    if fmt in ("TQ2_0", "TQ1_0"):
        trits = dataclasses.replace(_code("i2"), alphabet=Alphabet.of((-1, 0, 1)))
        scale = DenseType(DTYPES["f16"], (n, supers))
        t = QuantType("ternary", trits, DenseType(expressed, (n, k)), GroupSpec(1, 256), (("scale", scale),))
        return t, {"codes": parts["codes"], "scale": parts["scale"]}
    if fmt in ("Q4_1", "Q5_1"):
        bits, f16 = (4 if fmt == "Q4_1" else 5), DTYPES["f16"]
        groups = DenseType(f16, (n, k // 32))
        t = QuantType(
            "nested",
            _code(f"u{bits}"),
            DenseType(expressed, (n, k)),
            GroupSpec(1, 32),
            (("scale", groups), ("min", groups)),
        )
        return t, {"codes": parts["codes"], "scale": parts["scale"], "min": -parts["min"]}
    sub = _sub("i8", n, k // 16, 16, supers)
    t = QuantType("nested", _code("i6"), DenseType(expressed, (n, k)), GroupSpec(1, 16), (("scale", sub),))
    return t, {"codes": parts["codes"], "scale": {"codes": parts["sub_scale"], "scale": parts["d"]}}

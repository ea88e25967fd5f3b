"""Quantized modules carrying frozen codes, and the one custom op through which they export.

``qcompiler.quantize(model, "w4-g32")`` replaces each ``nn.Linear`` (and, when asked, each
``nn.Embedding``) by a ``QuantLinear``/``QuantEmbedding`` holding int8 codes, float32 scales and
optional int8 zero points. Their forward calls ``qcompiler::dequantize_affine``, which
``torch.export`` keeps as one node with constant operands; the frontend reads codes and qparams from
it without requantizing. torchao models are adopted the same way (``adopt_torchao``): codes, scales,
zero points and block size are read from the tensor subclass as they are. A weight read from an
act-order checkpoint (its ``g_idx`` names the group of each input column) calls
``qcompiler::dequantize_affine_gidx`` instead: a separate op, so the graphs (and artifacts) of every
other weight stay as they were.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from qcompiler.quant.conv1d import as_linear, is_linear, linear_weight, source_of
from qcompiler.quant.experts import unfuse_experts
from qcompiler.quant.registry import module_provider, provider
from qcompiler.quant.rtn import AffineQuant, QuantizeError, quantize_weight
from qcompiler.quant.schemes import Scheme, parse_scheme


@torch.library.custom_op("qcompiler::dequantize_affine", mutates_args=())
def dequantize_affine(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group: int,
    qmin: int,
    qmax: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(codes - zero) * scale`` in float32 with qparams repeated over groups of ``group`` along
    the last axis (a short tail group allowed), cast to ``out_dtype``. qmin/qmax state the code range."""
    k = codes.shape[-1]
    lead, small = tuple(codes.shape[:-1]), (torch.int8, torch.uint8, torch.int16)
    grouped = (*lead, k // group) if k % group == 0 else None
    if grouped is not None and codes.dtype in small and tuple(scale.shape) == grouped and zero is None:
        # whole groups: int8 codes are exact in float32; the scale broadcasts per group, one multiply
        out = codes.reshape(*grouped, group).to(torch.float32)
        return out.mul_(scale.to(torch.float32).unsqueeze(-1)).reshape(codes.shape).to(out_dtype)
    diff = codes.to(torch.int32)
    if zero is not None:
        diff = diff - zero.to(torch.int32).repeat_interleave(group, dim=-1)[..., :k]
    full_scale = scale.to(torch.float32).repeat_interleave(group, dim=-1)[..., :k]
    return (diff.to(torch.float32) * full_scale).to(out_dtype)


@dequantize_affine.register_fake
def _(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group: int,
    qmin: int,
    qmax: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return torch.empty(codes.shape, dtype=out_dtype, device=codes.device)


@torch.library.custom_op("qcompiler::dequantize_affine_gidx", mutates_args=())
def dequantize_affine_gidx(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    g_idx: torch.Tensor,
    group: int,
    qmin: int,
    qmax: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(codes - zero[..., g_idx]) * scale[..., g_idx]`` in float32, cast to ``out_dtype``: the
    qparams of column ``k`` are those of group ``g_idx[k]`` (act order). ``group`` is the size every
    group has (the lowering's block); qmin/qmax state the code range."""
    idx = g_idx.to(device=codes.device, dtype=torch.int64)
    diff = codes.to(torch.int32)
    if zero is not None:
        diff = diff - zero.to(torch.int32).index_select(-1, idx)
    return (diff.to(torch.float32) * scale.to(torch.float32).index_select(-1, idx)).to(out_dtype)


@dequantize_affine_gidx.register_fake
def _(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    g_idx: torch.Tensor,
    group: int,
    qmin: int,
    qmax: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return torch.empty(codes.shape, dtype=out_dtype, device=codes.device)


class _Frozen(nn.Module):
    """Holds one weight's codes and qparams as buffers, plus where they came from."""

    def __init__(self, q: AffineQuant, out_dtype: torch.dtype, source: dict[str, Any]) -> None:
        super().__init__()
        self.register_buffer("codes", q.codes.to(torch.int8).contiguous())
        self.register_buffer("scale", q.scale.contiguous())
        self.register_buffer("zero", None if q.zero is None else q.zero.contiguous())
        self.register_buffer("g_idx", None if q.g_idx is None else q.g_idx.to(torch.int32).contiguous())
        self.group, self.qmin, self.qmax = q.group, q.qmin, q.qmax
        self.out_dtype = out_dtype
        self.source = source

    def dequantized_weight(self) -> torch.Tensor:
        zero = self.zero if isinstance(self.zero, torch.Tensor) else None
        if isinstance(self.g_idx, torch.Tensor):
            return torch.ops.qcompiler.dequantize_affine_gidx(
                self.codes, self.scale, zero, self.g_idx, self.group, self.qmin, self.qmax, self.out_dtype
            )
        return torch.ops.qcompiler.dequantize_affine(
            self.codes, self.scale, zero, self.group, self.qmin, self.qmax, self.out_dtype
        )


class QuantLinear(_Frozen):
    """``y = x @ dequantize(codes).T + bias`` with frozen codes."""

    def __init__(
        self, q: AffineQuant, bias: torch.Tensor | None, out_dtype: torch.dtype, source: dict[str, Any]
    ) -> None:
        super().__init__(q, out_dtype, source)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.out_features, self.in_features = q.codes.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantized_weight(), self.bias)


class QuantEmbedding(_Frozen):
    """Row lookup in a frozen quantized table."""

    def __init__(self, q: AffineQuant, padding_idx: int | None, out_dtype: torch.dtype, source: dict[str, Any]) -> None:
        super().__init__(q, out_dtype, source)
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.dequantized_weight(), self.padding_idx)


def scale_dtype_for(weight_dtype: torch.dtype, policy: str = "f32") -> torch.dtype:
    """The dtype the built-in quantizer stores scales in (codes are computed against the stored
    scale): with ``policy`` ``source``, a bf16/fp16 weight's own dtype (what compressed-tensors holds
    for a model of that dtype); ``f16`` always (what ggml blocks hold); else float32."""
    if policy == "source" and weight_dtype in (torch.bfloat16, torch.float16):
        return weight_dtype
    return torch.float16 if policy == "f16" else torch.float32


def swap_module(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def quantize(
    model: nn.Module,
    scheme: str | Scheme,
    *,
    exclude: tuple[str, ...] = ("lm_head",),
    embeddings: bool = False,
    only: Collection[str] | None = None,
    scales: str = "f32",
) -> nn.Module:
    """Quantize ``model`` in place with the built-in round-to-nearest quantizer and return it.

    Every ``nn.Linear`` (and transformers ``Conv1D``, quantized as the Linear it computes:
    ``conv1d.py``) whose qualified name does not end with one of ``exclude`` is replaced by a
    ``QuantLinear`` (``nn.Embedding`` too when ``embeddings``); codes are frozen from here on. ``only``,
    when given, limits quantization to those qualified names (the modules a forward actually uses);
    ``scales``: the dtype policy of the scales (``scale_dtype_for``: ``f32``, ``source``, ``f16``).
    Scheme strings: ``w8-channel``, ``w8-g32``, ``w4-g32``, ``w4-g128-asym``, ``w2-g16-asym``.
    """
    unfuse_experts(model)  # MoE experts as per-expert Linears (quant/experts.py); a no-op without them
    declared = module_provider(scheme) if isinstance(scheme, str) else None
    if declared is not None:  # a backend's module scheme (quant/registry.py): K-quant blocks, mixtures
        assert isinstance(scheme, str)
        return declared.quantize(model, scheme, exclude, embeddings, only)
    s = parse_scheme(scheme) if isinstance(scheme, str) else scheme
    for fqn, mod in list(model.named_modules()):
        if not planned(fqn, mod, exclude, embeddings):
            continue
        if only is not None and fqn not in only:
            continue
        source = source_of(mod, s.name)
        mod, w = as_linear(mod), linear_weight(mod)
        q = quantize_weight(w.float(), s, scale_dtype_for(w.dtype, scales))
        if isinstance(mod, nn.Linear):
            swap_module(model, fqn, QuantLinear(q, mod.bias, w.dtype, source))
        else:
            assert isinstance(mod, nn.Embedding)
            swap_module(model, fqn, QuantEmbedding(q, mod.padding_idx, w.dtype, source))
    return model


def planned(fqn: str, mod: nn.Module, exclude: tuple[str, ...], embeddings: bool) -> bool:
    """Whether the built-in quantizer takes ``mod``: a Linear (or ``Conv1D``), an Embedding when
    ``embeddings``, not named by ``exclude``."""
    kind = is_linear(mod) or (embeddings and isinstance(mod, nn.Embedding))
    return kind and not any(fqn == e or fqn.endswith("." + e) for e in exclude)


def tied_twin(table: nn.Module, mod: nn.Module) -> nn.Module:
    """``mod`` (an output head or embedding tied to ``table``'s weight) reading ``table``'s own
    quantized buffers: the same tensors, so the export and every artifact hold them once."""
    if isinstance(mod, nn.Linear) and getattr(mod, "bias", None) is not None:
        raise QuantizeError("a tied head with a bias cannot share its embedding table's quantized weight")
    own = getattr(table, "twin_for", None)  # a module of a backend's scheme makes its own twin
    if own is not None:
        return own(mod)
    assert isinstance(table, _Frozen)
    zero = table.zero if isinstance(table.zero, torch.Tensor) else None
    g_idx = table.g_idx if isinstance(table.g_idx, torch.Tensor) else None
    q = AffineQuant(table.codes, table.scale, zero, table.qmin, table.qmax, table.group, g_idx)  # type: ignore[arg-type]
    twin = (
        QuantLinear(q, None, table.out_dtype, table.source)
        if isinstance(mod, nn.Linear)
        else QuantEmbedding(q, getattr(mod, "padding_idx", None), table.out_dtype, table.source)
    )
    for name in ("codes", "scale", "zero", "g_idx"):  # the table's own tensors, not copies
        held = isinstance(getattr(table, name), torch.Tensor)
        twin.register_buffer(name, table.get_buffer(name) if held else None)
    return twin


def quantize_plan(
    model: nn.Module,
    scheme: str,
    *,
    exclude: tuple[str, ...] = ("lm_head",),
    embeddings: bool = False,
    only: Collection[str] | None = None,
) -> dict[str, str]:
    """What ``quantize(model, scheme, ...)`` would do, decided from names, kinds and shapes alone (the
    model may hold no weights): module name -> the scheme (or ggml type) its weight gets. Tied
    modules are not planned (the streaming frontend refuses them with a mixture)."""
    declared = module_provider(scheme)
    if declared is not None:
        return declared.plan(model, scheme, exclude, embeddings, only)
    plan: dict[str, str] = {}
    parse_scheme(scheme)  # an unknown scheme fails here, before any weight is read
    for fqn, mod in model.named_modules():
        if not planned(fqn, mod, exclude, embeddings):
            continue
        if only is None or fqn in only:
            plan[fqn] = scheme
    return plan


def quantize_module(mod: nn.Module, scheme: str, out_dtype: torch.dtype, scales: str = "f32") -> nn.Module:
    """One ``nn.Linear``/``nn.Embedding`` holding its real (source-dtype) weight, quantized the way
    ``quantize`` would quantize it under ``scheme`` (a plan entry); the module computes in ``out_dtype``.
    ``scales``: ``source`` keeps a bf16/fp16 weight's dtype for its scales (``scale_dtype_for``)."""
    declared = provider(scheme)  # a backend's scheme quantizes the module its own way (f16 scales)
    new = declared.module(mod, scheme) if declared is not None else _affine_module(mod, parse_scheme(scheme), scales)
    new.out_dtype = out_dtype  # type: ignore[assignment]
    return new


def _affine_module(mod: nn.Module, s: Scheme, scales: str) -> nn.Module:
    source = source_of(mod, s.name)
    mod = as_linear(mod)
    w = mod.weight.detach()  # type: ignore[union-attr]
    assert isinstance(w, torch.Tensor)
    q = quantize_weight(w, s, scale_dtype_for(w.dtype, scales))  # widened to float32 a block at a time
    if isinstance(mod, nn.Linear):
        return QuantLinear(q, mod.bias, w.dtype, source)
    assert isinstance(mod, nn.Embedding)
    return QuantEmbedding(q, mod.padding_idx, w.dtype, source)

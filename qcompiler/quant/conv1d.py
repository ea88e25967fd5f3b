"""transformers' ``Conv1D`` (GPT-2's projections) as the ``nn.Linear`` it computes.

``Conv1D(nf, nx)`` computes ``addmm(bias, x, W)`` with ``W`` stored ``[K, N]`` (in x out): the
transpose of an ``nn.Linear`` weight. Its logical weight is ``W.T`` (``[N, K]``, out x in), and the
quantizers quantize that, along the input features, exactly as they would the equivalent Linear:
the same codes, scales and zero points. Only the float weight is transposed (before any
rounding); nothing is requantized. The quantized module is the Linear's (``QuantLinear``), its
``source`` recording the orientation the checkpoint holds (``ORIENTATION``), which the capture
carries into the ``q.source_weight``'s ``source`` attribute.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

ORIENTATION = "from Conv1D [K, N]"
"""The ``orientation`` entry of a quantized Conv1D's ``source``."""


def is_conv1d(mod: nn.Module) -> bool:
    """Whether ``mod`` is a transformers ``Conv1D`` (``weight [nx, nf]``, ``addmm`` forward)."""
    return type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and hasattr(mod, "nx")


def linear_shape(mod: nn.Module) -> tuple[int, int]:
    """``(N, K)`` of the Linear ``mod`` computes (an ``nn.Linear``, ``nn.Embedding`` or ``Conv1D``)."""
    w = mod.weight
    assert isinstance(w, torch.Tensor)
    n, k = int(w.shape[0]), int(w.shape[1])
    return (k, n) if is_conv1d(mod) else (n, k)


def as_linear(mod: nn.Module) -> nn.Module:
    """``mod`` itself, or for a ``Conv1D`` the ``nn.Linear`` it computes: weight ``W.T`` (the same
    values, transposed), the same bias."""
    if not is_conv1d(mod):
        return mod
    w, bias = mod.weight, mod.bias
    assert isinstance(w, torch.Tensor)
    k, n = int(w.shape[0]), int(w.shape[1])
    lin = nn.Linear(k, n, bias=isinstance(bias, torch.Tensor), device="meta")
    lin.weight = nn.Parameter(w.detach().t().contiguous(), requires_grad=False)
    if isinstance(bias, torch.Tensor):
        lin.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return lin


def linear_weight(mod: nn.Module) -> torch.Tensor:
    """The ``[N, K]`` weight of the Linear ``mod`` computes (``W.T`` of a ``Conv1D``), detached."""
    w = as_linear(mod).weight
    assert isinstance(w, torch.Tensor)
    return w.detach()


def conv1d_with_weight(template: nn.Module, w: torch.Tensor) -> nn.Module:
    """A ``Conv1D`` like ``template`` holding ``w`` (``[K, N]``, as the checkpoint stores it), its bias
    on the meta device: built without allocating a weight (``Conv1D`` takes no ``device``)."""
    mod = copy.copy(template)
    mod._parameters = {}  # the copy's own table, not the template's
    mod.weight = nn.Parameter(w, requires_grad=False)
    bias = template.bias
    if isinstance(bias, torch.Tensor):
        mod.bias = nn.Parameter(torch.empty(bias.shape, device="meta"), requires_grad=False)
    return mod


def is_linear(mod: nn.Module) -> bool:
    """An ``nn.Linear`` or a ``Conv1D``: a module the quantizers take as a Linear."""
    return isinstance(mod, nn.Linear) or is_conv1d(mod)


def source_of(mod: nn.Module, scheme: str) -> dict[str, str]:
    """The ``source`` a quantized module records: the built-in quantizer, its scheme, and for a
    ``Conv1D`` the orientation its checkpoint holds."""
    source = {"kind": "qcompiler.quantize", "scheme": scheme}
    if is_conv1d(mod):
        source["orientation"] = ORIENTATION
    return source

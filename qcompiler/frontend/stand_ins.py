"""Stand-ins for a streamed source's quantized modules: ``torch.export`` traces the model while its
weights are still being read and quantized.

What a quantized module contributes to the traced graph is its class, the shapes and dtypes of its
buffers and parameters (they are fake during capture) and its plain attributes, never a value.
``stand_in`` quantizes zero weights of one and of two rows; a buffer dim 0 or an int attribute that
doubles with the rows is scaled to the weight's ``N``, anything else must not change. ``same_module``
then holds the real module to its stand-in, and the streamed capture exports again with the real
modules if any differs: a stand-in can cost time, never change the graph.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from qcompiler.errors import QcError
from qcompiler.frontend.skeleton import fake_copy
from qcompiler.quant.conv1d import conv1d_with_weight, is_conv1d, linear_shape

PLAIN = (int, float, str, bool, type(None), torch.dtype, tuple, list, dict)
"""Attribute types compared by value; a module holding any other kind has no stand-in."""


def template_args(mod: nn.Module) -> tuple[Any, ...]:
    if is_conv1d(mod):
        return (mod.nf, mod.nx, getattr(mod, "bias", None) is not None)
    if isinstance(mod, nn.Linear):
        return (mod.in_features, mod.out_features, getattr(mod, "bias", None) is not None)
    assert isinstance(mod, nn.Embedding)
    return (mod.num_embeddings, mod.embedding_dim, mod.padding_idx)


def with_weight(template: nn.Module, w: torch.Tensor) -> nn.Module:
    """A new module of ``template``'s kind and arguments holding the real weight ``w`` (bias on meta)."""
    if is_conv1d(template):
        return conv1d_with_weight(template, w)
    # device= rather than ``with torch.device``: that context is process-wide, and this runs in worker
    # threads beside torch.export, whose constants it would put on the meta device
    mod = type(template)(*template_args(template), device="meta")
    mod.weight = nn.Parameter(w, requires_grad=False)
    if isinstance(mod, nn.Linear) and getattr(mod, "bias", None) is not None:
        mod.bias = nn.Parameter(torch.empty(mod.bias.shape, device="meta"), requires_grad=False)
    return mod


def stand_in(
    template: nn.Module,
    scheme: str,
    dtype: torch.dtype,
    scales: str,
    mode: FakeTensorMode,
    made: dict[tuple[Any, ...], nn.Module | None] | None = None,
) -> nn.Module | None:
    """The module ``quantize_module`` makes of ``template``'s weight under ``scheme``, with fake
    buffers of ``mode``; ``None`` when it cannot be told from zero weights (see the module docstring).
    ``made`` keeps one per kind of template (class, arguments, scheme, dtype, scales): a 22-layer
    model has 7 kinds of Linear and 154 of them, each its own fake copy."""
    made = {} if made is None else made
    key = (type(template), template_args(template), scheme, dtype, scales)
    if key not in made:
        made[key] = scaled_stand_in(template, scheme, dtype, scales)
    one = made[key]
    return None if one is None else fake_copy(copy.deepcopy(one), mode)  # fake_copy works in place


def scaled_stand_in(template: nn.Module, scheme: str, dtype: torch.dtype, scales: str) -> nn.Module | None:
    """``stand_in`` before its fake copy: meta tensors of the weight's rows."""
    from qcompiler.quant.modules import quantize_module

    n, k = linear_shape(template)

    def zeros(rows: int) -> torch.Tensor:  # ``rows`` output features, stored as the template stores them
        return torch.zeros(k, rows, dtype=dtype) if is_conv1d(template) else torch.zeros(rows, k, dtype=dtype)

    try:
        one, two = (quantize_module(with_weight(template, zeros(r)), scheme, torch.float32, scales) for r in (1, 2))
    except QcError:
        return None
    pairs = list(zip(one.modules(), two.modules(), strict=False))
    if len(pairs) != len(list(one.modules())) or len(pairs) != len(list(two.modules())):
        return None
    for a, b in pairs:
        if type(a) is not type(b) or not scale_tensors(a, b, n) or not scale_attrs(a, b, n):
            return None
    return one


def scale_tensors(a: nn.Module, b: nn.Module, n: int) -> bool:
    """Set ``a``'s buffers and parameters to meta tensors of ``N`` rows where ``b``'s have twice ``a``'s."""
    for table in ("_buffers", "_parameters"):
        ta, tb = getattr(a, table), getattr(b, table)
        if ta.keys() != tb.keys():
            return False
        for key, x in ta.items():
            y = tb[key]
            if x is None or y is None:
                if (x is None) != (y is None):
                    return False
                continue
            shape = scaled_shape(tuple(x.shape), tuple(y.shape), n)
            if shape is None or x.dtype != y.dtype:
                return False
            new = torch.empty(shape, dtype=x.dtype, device="meta")
            ta[key] = nn.Parameter(new, requires_grad=False) if table == "_parameters" else new
    return True


def scaled_shape(one: tuple[int, ...], two: tuple[int, ...], n: int) -> tuple[int, ...] | None:
    if one == two:
        return one
    if len(one) == len(two) and one[1:] == two[1:] and one and two[0] == 2 * one[0]:
        return (n * one[0], *one[1:])
    return None


def plain_attrs(mod: nn.Module) -> dict[str, Any] | None:
    attrs = {k: v for k, v in vars(mod).items() if not k.startswith("_") and k != "training"}
    return attrs if all(isinstance(v, PLAIN) for v in attrs.values()) else None


def scale_attrs(a: nn.Module, b: nn.Module, n: int) -> bool:
    """Set ``a``'s int attributes that double with the rows (``out_features``) to ``N`` rows' value."""
    pa, pb = plain_attrs(a), plain_attrs(b)
    if pa is None or pb is None or pa.keys() != pb.keys():
        return False
    for key, x in pa.items():
        y = pb[key]
        if type(x) is int and type(y) is int and x and y == 2 * x:
            setattr(a, key, n * x)
        elif type(x) is not type(y) or x != y:
            return False
    return True


def same_module(stand: nn.Module, real: nn.Module) -> bool:
    """Whether the real quantized module traces as its stand-in did: the same classes, tensor shapes
    and dtypes, and plain attributes."""
    mods = list(zip(stand.modules(), real.modules(), strict=False))
    if len(mods) != len(list(stand.modules())) or len(mods) != len(list(real.modules())):
        return False
    for a, b in mods:
        if type(a) is not type(b) or plain_attrs(a) is None or plain_attrs(a) != plain_attrs(b):
            return False
        if not same_tensor_shapes(a, b):
            return False
    return True


def same_tensor_shapes(a: nn.Module, b: nn.Module) -> bool:
    """The same parameter and buffer names, each of the same shape and dtype (or absent in both)."""
    for table in ("_buffers", "_parameters"):
        ta, tb = getattr(a, table), getattr(b, table)
        if ta.keys() != tb.keys():
            return False
        for key, x in ta.items():
            y = tb[key]
            if (x is None) != (y is None) or (x is not None and (x.shape != y.shape or x.dtype != y.dtype)):
                return False
    return True

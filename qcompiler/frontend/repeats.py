"""Whether a model's layers are one module repeated (``stamp.repeated_layers``): the same
submodules, tensor shapes and dtypes and attributes, and no per-layer list in the config that a
forward could read by ``layer_idx``."""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from torch import nn

from qcompiler.frontend.stand_ins import same_tensor_shapes

IGNORED = frozenset({"training", "layer_idx"})
"""Module attributes that may differ between repeated layers (``layer_idx`` keys only a KV cache)."""
PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device)


def uniform_config(config: Any, n: int) -> bool:
    """No list of the config with one entry per layer (``layer_types``) differs after layer 0: a forward
    may read it by ``layer_idx``, which ``same_layer`` ignores."""
    to_dict = getattr(config, "to_dict", None)
    values = cast(dict[str, Any], to_dict() if callable(to_dict) else vars(config))
    lists = [v for v in values.values() if isinstance(v, list | tuple) and len(v) == n]  # pyright: ignore[reportUnknownArgumentType]
    return all(x == v[1] for v in lists for x in v[2:])  # pyright: ignore[reportUnknownVariableType]


def same_layer(a: nn.Module, b: nn.Module, seen: set[tuple[int, int]] | None = None) -> bool:
    """Whether ``b`` is ``a`` again: the same submodules and classes, parameter and buffer shapes and
    dtypes, and attributes (by value, the very same object, or a module held unregistered that is the
    same again), ``IGNORED`` aside."""
    seen = set() if seen is None else seen
    if (id(a), id(b)) in seen:
        return True
    seen.add((id(a), id(b)))
    ma, mb = dict(a.named_modules()), dict(b.named_modules())
    if ma.keys() != mb.keys():
        return False
    for key, x in ma.items():
        y = mb[key]
        if type(x) is not type(y) or not same_tensors(x, y):
            return False
        va = {k: v for k, v in vars(x).items() if not k.startswith("_") and k not in IGNORED}
        vb = {k: v for k, v in vars(y).items() if not k.startswith("_") and k not in IGNORED}
        if va.keys() != vb.keys() or not all(same_value(va[k], vb[k], seen) for k in va):
            return False
    return True


def same_tensors(x: nn.Module, y: nn.Module) -> bool:
    same = x._non_persistent_buffers_set == y._non_persistent_buffers_set  # pyright: ignore[reportPrivateUsage]
    return same and same_tensor_shapes(x, y)


def same_value(u: Any, v: Any, seen: set[tuple[int, int]]) -> bool:
    if u is v:
        return True
    if type(u) is not type(v):
        return False
    if isinstance(u, PLAIN):
        return bool(u == v)
    if isinstance(u, nn.Module):
        return same_layer(u, v, seen)
    if isinstance(u, functools.partial):
        return u.func is v.func and same_value(u.args, v.args, seen) and same_value(u.keywords, v.keywords, seen)  # pyright: ignore[reportUnknownMemberType, reportUnknownArgumentType]
    if isinstance(u, list | tuple):
        return len(u) == len(v) and all(same_value(p, q, seen) for p, q in zip(u, v, strict=True))  # pyright: ignore[reportUnknownArgumentType]
    if isinstance(u, dict):
        return u.keys() == v.keys() and all(same_value(u[k], v[k], seen) for k in u)  # pyright: ignore[reportUnknownArgumentType, reportUnknownVariableType]
    return False

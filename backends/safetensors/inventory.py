"""The checkpoint inventory an architecture implies, from its config.json alone.

The transformers class named by ``architectures[0]`` is instantiated on the ``meta`` device (no
memory for weights), and its parameters (tied ones once) and persistent buffers give the exact
names and shapes a checkpoint must hold; its ``nn.Linear`` modules are what compressed-tensors'
``targets: ["Linear"]`` matches. The writer and the reader both check against this.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class InventoryError(ValueError):
    """The config names no architecture transformers can build."""


@dataclass(frozen=True)
class Inventory:
    architecture: str
    tensors: dict[str, tuple[tuple[int, ...], str]]
    """Checkpoint tensor name -> (shape, torch dtype name) for a dense checkpoint."""
    linears: frozenset[str]
    """Qualified names of every ``nn.Linear`` module."""


def architecture_inventory(config: dict[str, Any]) -> Inventory:
    import transformers

    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
    cls = getattr(transformers, arch, None) if arch else None
    if not isinstance(cls, type):
        raise InventoryError(f"architectures names no transformers model class (found {archs!r})")
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise InventoryError(f"model_type must be a string (found {model_type!r})")
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config")}
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
            with torch.device("meta"):
                model: nn.Module = cls(cfg)
    except Exception as e:  # a config transformers cannot build is untrusted input, not a crash
        raise InventoryError(f"transformers cannot build {arch} from this config: {type(e).__name__}: {e}") from None
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, p in model.named_parameters():
        tensors[name] = (tuple(p.shape), str(p.dtype).removeprefix("torch."))
    for mod_name, mod in model.named_modules():
        for b_name, b in mod.named_buffers(recurse=False):
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                tensors[f"{mod_name}.{b_name}" if mod_name else b_name] = (
                    tuple(b.shape),
                    str(b.dtype).removeprefix("torch."),
                )
    linears = frozenset(n for n, mod in model.named_modules() if isinstance(mod, nn.Linear))
    return Inventory(arch, tensors, linears)

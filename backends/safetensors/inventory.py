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
    """The config names no architecture transformers can build; ``field`` is the config key at fault."""

    def __init__(self, message: str, field: str = "architectures") -> None:
        self.field = field
        super().__init__(message)


@dataclass(frozen=True)
class Inventory:
    architecture: str
    tensors: dict[str, tuple[tuple[int, ...], str]]
    """Checkpoint tensor name -> (shape, torch dtype name) for a dense checkpoint."""
    linears: frozenset[str]
    """Qualified names of every ``nn.Linear`` module."""


LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_encoder_layers", "num_decoder_layers")
"""Config keys that multiply the number of modules built; bounded before anything is instantiated."""


def architecture_inventory(config: dict[str, Any], max_layers: int = 4096) -> Inventory:
    """Build the architecture on the meta device. ``max_layers`` bounds every layer count first (an
    untrusted config could otherwise ask for a billion modules); the reader passes the number of
    tensors the checkpoint actually holds."""
    import transformers

    for key in LAYER_KEYS:
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= max_layers):
            raise InventoryError(f"must be an integer in 1..{max_layers} (found {value!r})", key)

    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
    cls = getattr(transformers, arch, None) if arch else None
    if not isinstance(cls, type):
        raise InventoryError(f"architectures names no transformers model class (found {archs!r})")
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise InventoryError(f"must be a string (found {model_type!r})", "model_type")
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

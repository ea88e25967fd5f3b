"""A transformers model without its weights: what the streaming frontend captures.

- ``fake_model``: the model built under a ``FakeTensorMode`` (parameters and buffers are fake CPU
  tensors: shapes and dtypes only, no memory), which ``torch.export`` traces like a real one;
- ``real_buffers``: the model's non-persistent buffers (rotary ``inv_freq``...), which the config
  determines and no checkpoint holds, computed for real with every parameter on the meta device;
- ``is_fake``: whether a tensor holds no data (fake or meta); ``mode_of``: a fake model's mode;
- ``fake_copy``: a module's parameters and buffers swapped for fakes of the same shape and dtype
  (a quantized module whose real codes went to the blob store).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode


def is_fake(t: object) -> bool:
    return isinstance(t, FakeTensor) or (isinstance(t, torch.Tensor) and t.device.type == "meta")


@contextlib.contextmanager
def parameters_on_meta() -> Generator[None]:
    """Every parameter registered inside this block lives on the meta device (buffers stay real). A
    parameter already there is kept as it is: tying one module's parameter to another's registers
    the same object again, and the tie holds."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def fake_model(build: Any) -> tuple[nn.Module, FakeTensorMode]:
    """``build()`` run under a fresh ``FakeTensorMode``; returns the model and the mode."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = build()
    return model, mode


def real_buffers(build: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Qualified name -> value of every non-persistent buffer of ``build()``'s model, computed on CPU
    while its parameters live on the meta device (no weight memory)."""
    with parameters_on_meta():
        model = build()
    out: dict[str, torch.Tensor] = {}
    for mod_name, mod in model.named_modules():
        for b_name, b in mod.named_buffers(recurse=False):
            if b is not None and b_name in mod._non_persistent_buffers_set and not is_fake(b):
                out[prefix + (f"{mod_name}.{b_name}" if mod_name else b_name)] = b.detach()
    return out


def mode_of(model: nn.Module) -> FakeTensorMode | None:
    """The ``FakeTensorMode`` of a model ``fake_model`` built (its first fake parameter's), else ``None``."""
    p = next((p for p in model.parameters() if isinstance(p, FakeTensor)), None)
    return None if p is None else p.fake_mode


def fake_copy(mod: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """``mod`` with every parameter and buffer (real or meta) replaced, in place, by a fake CPU
    tensor of ``mode`` with the same shape and dtype."""
    with mode:
        for sub in mod.modules():
            for name, b in list(sub._buffers.items()):
                if b is not None:
                    sub._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
            for name, p in list(sub._parameters.items()):
                if p is not None:
                    sub._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=False)
    return mod

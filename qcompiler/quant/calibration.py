"""Calibration text for schemes that weigh errors by activations (``mixed-2416``): a diagonal-Hessian
estimate per Linear, ``H_k = sum over tokens of x_k^2`` of its input.

``calibrating(texts)`` sets the text for the quantization inside it (``qcompiler compile
--calibration FILE`` reads one text per line); ``hessians_for(model, names)`` runs the float model on
it once, with the model's own tokenizer (the source directory's), before any weight is replaced.
Without calibration text it returns ``None`` and a scheme falls back to the weights' own error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qcompiler.errors import UsageError

TEXTS: ContextVar[tuple[str, ...] | None] = ContextVar("qcompiler_calibration", default=None)


def read_calibration(path: str) -> tuple[str, ...]:
    """One calibration text per non-empty line of ``path`` (UTF-8); a typed error names the file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--calibration {path}: cannot read it as UTF-8 text ({e})") from None
    texts = tuple(line.strip() for line in lines if line.strip())
    if not texts:
        raise UsageError(f"--calibration {path}: no text in it (expected one text per line, found none)")
    return texts


@contextlib.contextmanager
def calibrating(texts: tuple[str, ...] | None) -> Generator[None]:
    token = TEXTS.set(texts)
    try:
        yield
    finally:
        TEXTS.reset(token)


def hessians_for(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor] | None:
    """``{name: float64 [K]}``, the sum of squared inputs of each named Linear over the calibration
    text (one forward per text), or ``None`` without calibration text."""
    texts = TEXTS.get()
    if not texts:
        return None
    inner = _inner(model)
    tokenizer = _tokenizer(inner)
    sums: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...], object], None]:
        def record(_: nn.Module, args: tuple[torch.Tensor, ...], __: object) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
            sums[name] = sums.get(name, torch.zeros(x.shape[-1], dtype=torch.float64)) + (x * x).sum(0)

        return record

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]
    try:
        with torch.no_grad():
            for text in texts:
                inner(**tokenizer(text, return_tensors="pt", truncation=True, max_length=512))
    finally:
        for h in handles:
            h.remove()
    return sums


def _inner(model: nn.Module) -> nn.Module:
    """The transformers model inside ``model`` (the frontend wraps it): the one with a ``name_or_path``."""
    for mod in model.modules():
        if str(getattr(mod, "name_or_path", "") or ""):
            return mod
    raise UsageError("--calibration needs the source's tokenizer: the model was not loaded from a directory")


def _tokenizer(model: nn.Module) -> Any:
    from transformers import AutoTokenizer

    where = str(getattr(model, "name_or_path", ""))
    if not Path(where).is_dir():
        raise UsageError(f"--calibration needs the source's tokenizer: {where} is not a directory")
    try:
        return AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError) as e:
        raise UsageError(f"--calibration: cannot load the tokenizer of {where} ({e})") from None

"""Calibration text for schemes that weigh errors by activations (``mixed-2416``): a diagonal-Hessian
estimate per Linear, ``H_k = sum over tokens of x_k^2`` of its input.

``calibrating(texts)`` sets the text for the quantization inside it (``qcompiler compile
--calibration FILE`` reads one text per line); ``calibrated(model)`` runs the float model on it with
the model's own tokenizer (the source directory's), before any weight is replaced; ``hessians_for``
collects each Linear's ``X^T X`` (GPTQ's Hessian; its diagonal is the sensitivity estimate) and
``importance_for`` the model's output change with one weight at a time at 2 bits. Without calibration
text a scheme falls back to the weights' own error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Mapping
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


FULL_HESSIAN_MAX_K = 4096
"""Inputs up to this width get the full ``X^T X`` (GPTQ's error feedback); wider ones the diagonal only
(a 14336-wide input's full Hessian would be 1.6 GB)."""


class Calibrated:
    """The float model run on the calibration text: one forward per text (the Hessians see no
    padding), and the texts as one padded batch for the output comparisons (``loss``)."""

    def __init__(self, model: nn.Module, texts: tuple[str, ...]) -> None:
        self.inner = _inner(model)
        tokenizer = _tokenizer(self.inner)
        self.batches = [tokenizer(t, return_tensors="pt", truncation=True, max_length=512) for t in texts]
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.batch = tokenizer(list(texts), return_tensors="pt", truncation=True, max_length=512, padding=True)
        self.mask = self.batch["attention_mask"].to(torch.float64).unsqueeze(-1)
        out = self._forward()
        self.encoder = _is_encoder(out)
        self.reference = self._masked(out)
        self.dims = tuple(range(1, self.reference.dim()))  # every axis but the text's
        self.pooled = _pooled(self.reference, self.mask) if self.encoder else None
        self.norms = (self.reference**2).sum(self.dims).clamp_min(1e-30)

    def each(self) -> None:
        """Every text through the model alone (what a forward hook records)."""
        with torch.no_grad():
            for b in self.batches:
                self.inner(**b)

    def _forward(self) -> object:
        with torch.no_grad():
            return self.inner(**self.batch)

    def _masked(self, out: object) -> torch.Tensor:
        return _first(out).to(torch.float64) * self.mask

    def output(self) -> torch.Tensor:
        """The model's first output (hidden states or logits) on the padded batch, float64, padding zeroed."""
        return self._masked(self._forward())

    def loss(self) -> float:
        """Relative squared change of the outputs against the float model's."""
        got = self.output()
        return float(((got - self.reference) ** 2).sum() / (self.reference**2).sum().clamp_min(1e-30))

    def losses(self) -> list[float]:
        """Each text's loss against the float model (the measured allocation scores the worst of
        them): for an encoder (hidden states out, no logits), the cosine its sentence embedding loses
        (mean over the text's tokens, as sentence-transformers pools); otherwise the relative squared
        change of its logits."""
        got = self.output()
        if self.pooled is not None:
            cosine = torch.nn.functional.cosine_similarity(_pooled(got, self.mask), self.pooled, dim=-1)
            return [float(v) for v in 1.0 - cosine]
        return [float(v) for v in ((got - self.reference) ** 2).sum(self.dims) / self.norms]


def calibrated(model: nn.Module) -> Calibrated | None:
    """The calibration run of ``model`` (before any weight is replaced), or ``None`` without text."""
    texts = TEXTS.get()
    return Calibrated(model, texts) if texts else None


def hessians_for(model: nn.Module, names: list[str], run: Calibrated) -> dict[str, torch.Tensor]:
    """``{name: float64}``: ``X^T X`` over the calibration tokens of each named Linear's input
    (``[K, K]``, or its diagonal ``[K]`` past ``FULL_HESSIAN_MAX_K``)."""
    sums: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...], object], None]:
        def record(_: nn.Module, args: tuple[torch.Tensor, ...], __: object) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
            h = x.T @ x if x.shape[-1] <= FULL_HESSIAN_MAX_K else (x * x).sum(0)
            sums[name] = sums[name] + h if name in sums else h

        return record

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]
    try:
        run.each()
    finally:
        for h in handles:
            h.remove()
    return sums


def importance_for(
    model: nn.Module,
    run: Calibrated,
    weights: dict[str, torch.Tensor],
    low: Callable[[str], tuple[torch.Tensor, float]],
) -> dict[str, float]:
    """Per weight: the output change on the calibration text (``Calibrated.losses``, their mean) with
    that weight alone replaced by its 2-bit decode (``low(name)``: the decode and the error the
    allocator measures for it), over that error, so a gain times the importance is in units of the
    model's output error."""
    out: dict[str, float] = {}
    for name, w in weights.items():
        param = model.get_submodule(name).weight
        assert isinstance(param, torch.Tensor)
        dq, err = low(name)
        with torch.no_grad():
            param.copy_(dq.to(param.dtype))
            try:
                each = run.losses()
                lost = sum(each) / len(each)
            finally:
                param.copy_(w)
        out[name] = max(lost, 1e-12) / max(err, 1e-30)
    return out


def swapped_losses(
    model: nn.Module, run: Calibrated, decodes: Mapping[str, torch.Tensor], originals: Mapping[str, torch.Tensor]
) -> list[float]:
    """Each calibration text's loss with each named Linear's weight replaced by its decode; every
    weight is back at ``originals[name]`` afterwards."""
    params: dict[str, torch.Tensor] = {}
    for name in decodes:
        param = model.get_submodule(name).weight
        assert isinstance(param, torch.Tensor)
        params[name] = param
    with torch.no_grad():
        try:
            for name, dq in decodes.items():
                params[name].copy_(dq.to(params[name].dtype))
            return run.losses()
        finally:
            for name, param in params.items():
                param.copy_(originals[name])


def _first(out: object) -> torch.Tensor:
    first = out[0] if isinstance(out, tuple | list) else getattr(out, "logits", None)
    if first is None:
        first = out.last_hidden_state if hasattr(out, "last_hidden_state") else out  # type: ignore[union-attr]
    assert isinstance(first, torch.Tensor)
    return first


def _is_encoder(out: object) -> bool:
    """Whether a model's output is hidden states for pooling (a ``last_hidden_state``, no logits)."""
    return (
        not isinstance(out, tuple | list) and getattr(out, "logits", None) is None and hasattr(out, "last_hidden_state")
    )


def _pooled(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T, H]`` hidden states (padding zeroed) -> ``[B, H]``, the mean over each text's tokens."""
    return hidden.sum(1) / mask.sum(1).clamp_min(1.0)


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

"""Schemes a backend adds to the built-in quantizer, by name (``SCHEMES`` in its declarations,
``qcompiler/plugins.py``): the core parses ``w4-g128``-style schemes itself and asks the declaring
backend for any other name (the gguf backend declares llama.cpp's ``q4_0`` ... ``q4_k_m``).

A provider is an object with the methods of ``SchemeProvider``. It answers two kinds of scheme:

- an *affine* scheme (``scheme(name)`` returns a ``Scheme`` whose ``rounding`` names it): quantized
  by the core's affine modules, the codes and scales rounded by the provider (``round``), e.g. the
  bytes llama.cpp's reference quantizer writes;
- a *module* scheme (``scheme(name)`` is ``None``): the provider plans and quantizes whole modules
  itself (``plan``, ``quantize``, ``module``), e.g. K-quant blocks and llama.cpp's mixtures.

Optional attributes: ``streamable = False`` (the scheme quantizes the whole model at once, never
module by module); ``ties(name)`` (a weight tied to several modules is quantized once, at the first
module ``plan`` names, and the others read its buffers: ``quant.modules.tied_twin``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

from qcompiler import plugins

if TYPE_CHECKING:
    import torch
    from torch import nn

    from qcompiler.quant.rtn import AffineQuant
    from qcompiler.quant.schemes import Scheme


class SchemeProvider(Protocol):
    described: str
    """How the ``SchemeError`` grammar lists this provider's affine schemes."""

    def scheme(self, name: str) -> Scheme | None: ...

    def round(self, w: torch.Tensor, scheme: Scheme) -> AffineQuant: ...

    def plan(
        self, model: nn.Module, name: str, exclude: tuple[str, ...], embeddings: bool, only: Collection[str] | None
    ) -> dict[str, str]: ...

    def quantize(
        self, model: nn.Module, name: str, exclude: tuple[str, ...], embeddings: bool, only: Collection[str] | None
    ) -> nn.Module: ...

    def module(self, mod: nn.Module, name: str) -> nn.Module: ...


CORE_FAMILIES = {"mixed-2416": "qcompiler.quant.mixprec_module:PROVIDER"}
"""Scheme families of the core quantizer that take options (``mixed-2416-g128-r2.8``): prefix -> provider."""


def provider(name: str) -> SchemeProvider | None:
    """The provider a backend declares for scheme ``name``, or the core family whose prefix it has
    (imported on first use), or ``None``."""
    ref = plugins.declared("SCHEMES").get(name)
    if ref is None:
        ref = next((r for p, r in CORE_FAMILIES.items() if name == p or name.startswith(p + "-")), None)
    return None if ref is None else plugins.provide(ref)


def whole_model(name: str | None) -> bool:
    """Whether scheme ``name`` quantizes the whole model at once (``streamable = False``), never module
    by module; ``None`` (no scheme) is not."""
    p = provider(name) if name else None
    return p is not None and not getattr(p, "streamable", True)


def shares_tied(name: str) -> bool:
    """Whether scheme ``name`` quantizes a tied weight once for all its modules (``ties``)."""
    p = provider(name)
    ties = getattr(p, "ties", None)
    return bool(ties(name)) if ties is not None else False


def module_provider(name: str) -> SchemeProvider | None:
    """``provider(name)`` when ``name`` is a module scheme (the provider quantizes whole modules)."""
    p = provider(name)
    return p if p is not None and p.scheme(name) is None else None


def affine_names() -> dict[str, list[str]]:
    """Each provider's description -> the affine scheme names it declares (for the grammar)."""
    out: dict[str, list[str]] = {}
    for name in plugins.declared("SCHEMES"):
        p = provider(name)
        if p is not None and p.scheme(name) is not None:
            out.setdefault(p.described, []).append(name)
    return out

"""What each backend package declares for the core's registries, found without the core naming one.

Backend packages are found through the entry-point group ``qcompiler.backends`` (ours: one line each
in ``pyproject.toml``; a third-party backend adds its own). Each package's ``__init__`` declares
tables of providers as strings relative to the package, so reading the declarations imports nothing
heavy; a provider is imported when its key is first used:

| table | key | provider |
|---|---|---|
| ``TARGETS`` | a ``--target`` name | ``.backend:GgufBackend``: the ``Backend`` subclass |
| ``LAYOUTS`` | ``(family, version)`` of a code layout | the module whose ``Layout`` subclasses define it |
| ``BLOB_SCHEMES`` | a blob location scheme (``gguf`` of ``gguf:FILE#T``) | the module whose ``@reader`` reads it |
| ``SOURCE_FILES`` | a single-file SOURCE suffix (``.gguf``) | ``.source:load_gguf_source``, ``(spec, streamed=True)`` |
| ``SCHEMES`` | a ``--scheme`` name (``q4_k_m``) | ``.schemes:GGML``: its provider (``quant/registry.py``) |
| ``PREQUANTIZED`` | a pre-quantized directory's ``quant_method`` (``gptq``) | ``.prequant_formats:load_gptq`` |
| ``CHECKPOINTS`` | an HF-style directory's weight files (``safetensors``) | ``.source``: ``frontend/checkpoint.py`` |
| ``KERNELS`` | a runtime kernel id (``KernelSpec.id``) | ``.kernels:KERNELS``: the ``KernelSpec`` table holding it |
| ``LOWERINGS`` | an op a backend defines (``qcompiler::dequantize_ggml``) | ``.lowering``: its ``@lowers`` |

    plugins.declared("LAYOUTS")[("ggml-k", 1)]   # "qcompiler.backends.gguf.layouts_k"
    plugins.provide("qcompiler.backends.gguf.source:load_gguf_source")   # the function
"""

from __future__ import annotations

import functools
import importlib
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any

from qcompiler.errors import UsageError

GROUP = "qcompiler.backends"
TABLES = (
    "TARGETS",
    "LAYOUTS",
    "BLOB_SCHEMES",
    "SOURCE_FILES",
    "SCHEMES",
    "CHECKPOINTS",
    "KERNELS",
    "LOWERINGS",
    "PREQUANTIZED",
)


@functools.cache
def packages() -> tuple[ModuleType, ...]:
    """Every backend package of the entry-point group, imported (its declarations only), by name."""
    found = sorted(entry_points(group=GROUP), key=lambda ep: ep.name)
    return tuple(importlib.import_module(ep.value) for ep in found)


@functools.cache
def declared(table: str) -> dict[Any, str]:
    """``table`` of every backend package merged, each provider made absolute (``package.module``
    or ``package.module:attr``). Two packages declaring one key is a ``UsageError`` naming both."""
    if table not in TABLES:
        raise ValueError(f"unknown declaration table {table!r} (known: {', '.join(TABLES)})")
    out: dict[Any, str] = {}
    owner: dict[Any, str] = {}
    for pkg in packages():
        for key, rel in dict(getattr(pkg, table, {})).items():
            if key in out:
                raise UsageError(f"{table} {key!r} is declared by both {owner[key]} and {pkg.__name__}")
            out[key], owner[key] = absolute(pkg.__name__, str(rel)), pkg.__name__
    return out


def absolute(package: str, rel: str) -> str:
    """``.module:attr`` relative to ``package`` -> ``package.module:attr`` (absolute ones as they are)."""
    return f"{package}{rel}" if rel.startswith(".") else rel


def provide(ref: str) -> Any:
    """The module ``ref`` names, imported, or its attribute after ``:``."""
    module_name, _, attr = ref.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module

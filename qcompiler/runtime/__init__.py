"""The loader and CPU runtime: ``load`` (gates, kernel admission, dispatch trace, materialisation,
self-check) and ``Session`` (execution from the QIR graph, KV cache, greedy decoding)."""

from __future__ import annotations

from qcompiler.runtime.execute import Session
from qcompiler.runtime.load import LoadedModel, LoadError, load

__all__ = ["LoadError", "LoadedModel", "Session", "load"]

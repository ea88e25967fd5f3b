"""qcompiler: compile quantized PyTorch models into verified deployable artifacts.

``qcompiler.quantize``, ``qcompiler.capture``, ``qcompiler.capture_source`` and ``qcompiler.load`` import
torch on first use, so ``import qcompiler`` (and ``qcompiler opt``) stays light.
"""

from __future__ import annotations

from typing import Any

from qcompiler.version import __version__

__all__ = ["__version__"]

_API = ("quantize", "capture", "capture_source")


def __getattr__(name: str) -> Any:
    if name in _API:
        from qcompiler import api

        return getattr(api, name)
    if name in ("load", "Session"):
        from qcompiler import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'qcompiler' has no attribute {name!r}")

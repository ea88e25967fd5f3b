"""qcompiler: compile quantized PyTorch models into verified deployable artifacts.

``qcompiler.quantize``, ``qcompiler.capture`` and ``qcompiler.capture_source`` import torch on first
use, so ``import qcompiler`` (and ``qcompiler opt``) stays light.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = ("quantize", "capture", "capture_source")


def __getattr__(name: str) -> Any:
    if name in _API:
        from qcompiler import api

        return getattr(api, name)
    raise AttributeError(f"module 'qcompiler' has no attribute {name!r}")

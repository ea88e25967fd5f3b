"""``emit-container``: Hand the finished module to the target backend, which writes the artifact transactionally.


Registered now so pipelines can name it and be validated; its work lands with its own issue. Until
then the pass manager refuses any pipeline that contains it, before running anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qcompiler.passes.base import UnimplementedPass


@dataclass(frozen=True)
class EmitContainerPass(UnimplementedPass):
    """Hand the module to the target backend (not implemented yet)."""

    name: ClassVar[str] = "emit-container"
    requires: ClassVar[frozenset[str]] = frozenset(
        {"semantics-frozen", "axes-canonical", "shards-placed", "layouts-packed", "qdq-fused"}
    )
    establishes: ClassVar[frozenset[str]] = frozenset()
    target: str = ""
    """backend to emit (safetensors, gguf, onnx, triton)"""

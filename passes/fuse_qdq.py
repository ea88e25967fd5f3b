"""``fuse-qdq``: Fold ``q.dequantize -> linear/matmul/embedding`` into ``q.linear``/``q.embedding`` when the
dequantize has no other user and constant qparams; or the reverse for targets that want QDQ.

Registered now so pipelines can name it and be validated; its work lands with its own issue. Until
then the pass manager refuses any pipeline that contains it, before running anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qcompiler.passes.base import UnimplementedPass


@dataclass(frozen=True)
class FuseQdqPass(UnimplementedPass):
    """Fold or materialise dequantize->op patterns (not implemented yet)."""

    name: ClassVar[str] = "fuse-qdq"
    requires: ClassVar[frozenset[str]] = frozenset({"semantics-frozen", "axes-canonical"})
    establishes: ClassVar[frozenset[str]] = frozenset({"qdq-fused"})
    direction: str = "fold"
    """``fold`` DQ->op into q.* ops, or ``materialize`` DQ for QDQ targets"""

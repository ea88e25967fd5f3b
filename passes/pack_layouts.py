"""``pack-layouts``: Choose each quantized tensor's physical layout for the target from the layout registry and prove
``unpack(pack(Q)) == Q`` per tensor; anything else is a conversion, refused unless allowed.

Registered now so pipelines can name it and be validated; its work lands with its own issue. Until
then the pass manager refuses any pipeline that contains it, before running anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qcompiler.passes.base import UnimplementedPass


@dataclass(frozen=True)
class PackLayoutsPass(UnimplementedPass):
    """Choose and prove physical layouts for the target (not implemented yet)."""

    name: ClassVar[str] = "pack-layouts"
    requires: ClassVar[frozenset[str]] = frozenset({"shards-placed"})
    establishes: ClassVar[frozenset[str]] = frozenset({"layouts-packed"})
    target: str = ""
    """backend whose layouts to choose"""
    allow_conversion: bool = False
    """allow changes to codes/groups/qparams (measured and recorded)"""

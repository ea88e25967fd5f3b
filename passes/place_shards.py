"""``place-shards``: Record file shards (transport) and parallel placement (TP/PP/EP) as separate facts on every
tensor-table entry; group boundaries stay with one owner.

Registered now so pipelines can name it and be validated; its work lands with its own issue. Until
then the pass manager refuses any pipeline that contains it, before running anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qcompiler.passes.base import UnimplementedPass


@dataclass(frozen=True)
class PlaceShardsPass(UnimplementedPass):
    """Record file shards and parallel placement per tensor (not implemented yet)."""

    name: ClassVar[str] = "place-shards"
    requires: ClassVar[frozenset[str]] = frozenset({"axes-canonical"})
    establishes: ClassVar[frozenset[str]] = frozenset({"shards-placed"})
    tp: int = 1
    """tensor-parallel degree (placement, kept apart from file sharding)"""
    max_shard_size: str = "5GB"
    """largest file shard"""

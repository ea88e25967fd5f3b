"""``place-shards``: where every tensor lives, as two separate facts.

1. **Placement** (parallel topology): which ranks hold which part of each tensor. With ``tp=1``
   every tensor is ``replicate``d whole; the module records ``topology = {tp = 1, pp = 1}``.
   Tensor parallelism (a later change) will write ``split`` placements with group-boundary
   ownership here without touching file sharding.
2. **File shards** (transport): the target's container tensors (exact byte sizes from its backend,
   packed sizes included) are cut greedily into files of at most ``max-shard-size`` bytes, in
   tensor-table order, the way transformers' ``save_pretrained`` cuts them; a tensor larger than
   the limit gets a file of its own, and one weight's codes and qparams stay together. Each
   tensor-table entry gets ``file_shard = i`` (1-based); the module records
   ``file_shards = {target = "safetensors", count = N, max_size = S}``.

Before: ``tensor @w.codes : i8[64,64] = blob<...>``. After::

    tensor @w.codes : i8[64,64] = blob<...> {file_shard = 1, placement = "replicate"}
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from qcompiler.backends import get_backend
from qcompiler.errors import PassError, UsageError
from qcompiler.ir.core import Module
from qcompiler.ir.module_attrs import PLACEMENT_REPLICATE
from qcompiler.ir.module_attrs import PLACEMENTS as PLACEMENTS  # the known placements (the verifier's table)
from qcompiler.passes.base import Pass, PassContext

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
DEFAULT_MAX_SHARD = "5GB"


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units like transformers; ``GiB`` for binary); plain bytes too."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in UNITS:
        raise UsageError(
            f"max shard size {text!r}: expected a number with an optional unit (KB, MB, GB, TB, KiB, MiB, GiB)"
        )
    size = int(float(match.group(1)) * UNITS[unit])
    if size <= 0:
        raise UsageError(f"max shard size {text!r} must be positive")
    return size


@dataclass(frozen=True)
class PlaceShardsPass(Pass):
    """Record placement (tp=1) and cut file shards (see the module docstring)."""

    name: ClassVar[str] = "place-shards"
    summary: ClassVar[str] = "placement and file shards, recorded separately"
    requires: ClassVar[frozenset[str]] = frozenset({"axes-canonical"})
    establishes: ClassVar[frozenset[str]] = frozenset({"shards-placed"})
    tp: int = 1
    """tensor-parallel ranks (only 1 is supported so far)"""
    max_shard_size: str = DEFAULT_MAX_SHARD
    """largest file, e.g. 5GB, 500MB, 2GiB, or plain bytes"""
    target: str = ""
    """backend whose container the file shards are cut for"""

    def run(self, module: Module, ctx: PassContext) -> Module:
        if self.tp != 1:
            raise PassError(f"tp={self.tp}: tensor-parallel placement is not supported yet (tp=1 only)")
        if not self.target:
            raise PassError("place-shards needs target=NAME (qcompiler compile --target)")
        limit = parse_size(self.max_shard_size)
        backend = get_backend(self.target)
        if not backend.shardable and self.max_shard_size != DEFAULT_MAX_SHARD:
            raise PassError(
                f"max-shard-size={self.max_shard_size}: target {self.target} writes a single container file "
                "(its runtime loads one file), so it cannot be sharded"
            )
        cut = limit if backend.shardable else 2**63 - 1
        shard_of: dict[str, int] = {}
        shard, used = 1, 0
        for ct in backend.container_tensors(module):
            if ct.file != "model":
                continue
            placed = next((shard_of[o] for o in ct.owners if o in shard_of), None)
            if placed is None:
                if used and used + ct.nbytes > cut:
                    shard, used = shard + 1, 0
                placed = shard
            used += ct.nbytes
            shard_of.update(dict.fromkeys(ct.owners, placed))
        for name, decl in module.tensors.items():
            decl.attrs["placement"] = PLACEMENT_REPLICATE
            if name in shard_of:
                decl.attrs["file_shard"] = shard_of[name]
        module.attrs["topology"] = {"tp": 1, "pp": 1}
        module.attrs["file_shards"] = {"target": self.target, "count": shard, "max_size": limit}
        ctx.count("place-shards.files", shard)
        return module

"""The streamed parity ladder: rungs 1-3 of ``qcompiler.parity`` weight by weight, in threads.

Each weight is unpacked and decoded once and dropped before the window moves on, and a weight of
more than ``parity_rows.LADDER_BLOCK`` (1M) elements is checked a block of rows at a time
(``parity_rows``), so the ladder's memory follows the stored codes of the largest weights and one
block of their decode, not the model and not a whole decoded head.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from qcompiler.ir.core import Graph, Module, Op
from qcompiler.ir.types import QuantType
from qcompiler.parallel import ordered_map
from qcompiler.parity import (
    RungResult,
    decoded,
    metrics_of,
    operator_parity,
    pack_round_trip,
    parts,
    rung1_row,
    rung2_reconstruction,
    weights,
)
from qcompiler.parity_rows import LADDER_BLOCK, check_rows
from qcompiler.quant import row_blocks


@dataclass
class Ladder:
    """Rungs 1-3 of every weight plus the sha256 of each reference decode (float32 little-endian)."""

    r1: list[RungResult] = field(default_factory=list[RungResult])
    r2: list[RungResult] = field(default_factory=list[RungResult])
    r3: list[RungResult] = field(default_factory=list[RungResult])
    decode_sha256: dict[str, str] = field(default_factory=dict[str, str])


Item = tuple[str, Op, QuantType, "torch.Tensor | None"]
"""One weight of the ladder: name, ``q.weight`` op, descriptor, rung 3's input (``None``: not a linear)."""

Checked = tuple[RungResult, str, list[RungResult], list[RungResult]]
"""Rung 1's row, the decode's sha256, rung 2's rows, rung 3's rows."""


def ladder(
    m: Module,
    effective: Mapping[str, torch.Tensor | np.ndarray] | None,
    float_weights: Mapping[str, torch.Tensor] | None = None,
    *,
    rows: int = 4,
    seed: int = 0,
    jobs: int = 1,
) -> Ladder:
    """``rung1_pack_unpack``, ``rung2_reconstruction`` (when ``effective`` is given) and
    ``rung3_operators`` weight by weight (``2 * jobs`` weights in flight at most), in ``jobs``
    threads; the same rows, order and seeded inputs as the three functions for any ``jobs``.
    ``effective`` may state ``same_bound_bytes(name, m, op, t)``: that weight is the reference's own
    bytes, and rung 2 holds without a decode."""
    gen = torch.Generator().manual_seed(seed)
    items: list[Item] = []
    for name, op, t in weights(m):  # the inputs are drawn in weight order, before any work
        linear = t.req == "linear" and t.rank == 2
        items.append((name, op, t, torch.randn(rows, int(t.shape[1]), generator=gen) if linear else None))

    def one(item: Item) -> Checked:
        name, op, t, x = item
        same_as = getattr(effective, "same_bound_bytes", None)
        same = bool(callable(same_as) and same_as(name, m, op, t))
        if row_blocks.huge(t, LADDER_BLOCK):
            ok, digest, r2, r3 = check_rows(m, op, t, name, x, effective, float_weights, same)
            return rung1_row(name, t, ok), digest, r2, r3
        return check_whole(m, item, effective, float_weights, same)

    out = Ladder()
    for (name, _, _, _), (r1, digest, r2, r3) in zip(items, ordered_map(one, items, jobs), strict=True):
        out.r1.append(r1)
        out.decode_sha256[name] = digest
        out.r2 += r2
        out.r3 += r3
    return out


def check_whole(
    m: Module, item: Item, effective: Mapping[str, Any] | None, float_weights: Mapping[str, Any] | None, same: bool
) -> Checked:
    """The ladder of one weight decoded whole."""
    name, op, t, x = item
    codes = parts(m, {"codes": op.attrs["codes"]})["codes"]
    assert isinstance(codes, np.ndarray)
    ok, logical = pack_round_trip(codes, t)
    got = decoded(m, op, t, logical)
    del logical
    digest = hashlib.sha256(memoryview(np.ascontiguousarray(got, "<f4")).cast("B")).hexdigest()  # pyright: ignore[reportArgumentType]
    r2: list[RungResult] = []
    if same:
        r2.append(RungResult(2, name, True, "", {"max_abs_diff": 0.0}))
    elif effective is not None:
        r2 += rung2_reconstruction(single(m, op), effective, {name: got})
    r3: list[RungResult] = []
    if x is not None:
        floats = float_weights.get(name) if float_weights is not None else None
        r3.append(RungResult(3, name, True, "", metrics_of(operator_parity(x, got, floats))))
    return rung1_row(name, t, ok), digest, r2, r3


def single(m: Module, op: Op) -> Module:
    """A view of ``m`` whose only op is ``op`` (for the per-weight rung functions)."""
    g = Graph("weight")
    g.ops = [op]
    return Module(m.name, tensors=m.tensors, graphs=[g], attrs=m.attrs, base_dir=m.base_dir)

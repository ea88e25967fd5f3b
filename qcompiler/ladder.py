"""The streamed parity ladder: rungs 1-3 of ``qcompiler.parity`` weight by weight, in threads.

Each weight is unpacked and decoded once and dropped before the window moves on, and a weight of
more than ``parity_rows.LADDER_BLOCK`` (1M) elements is checked a block of rows at a time
(``parity_rows``), so the ladder's memory follows the stored codes of the largest weights and one
block of their decode, not the model and not a whole decoded head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from qcompiler.decode_digest import DECODE_DIGEST
from qcompiler.ir import row_blocks
from qcompiler.ir.core import Graph, Module, Op
from qcompiler.ir.types import QuantType
from qcompiler.parallel import ordered_map
from qcompiler.parity import (
    RungResult,
    decoded,
    needed_parts,
    pack_round_trip,
    rung1_row,
    rung2_reconstruction,
    rung3_input,
    weights,
)
from qcompiler.parity_rows import LADDER_BLOCK, DecodeEvidence, check_rows, row_reader
from qcompiler.proofs import Proofs, key_of


@dataclass
class Ladder:
    """Rungs 1-3 of every weight plus the digest of each reference decode (float32 little-endian;
    ``decode_digest``)."""

    r1: list[RungResult] = field(default_factory=list[RungResult])
    r2: list[RungResult] = field(default_factory=list[RungResult])
    r3: list[RungResult] = field(default_factory=list[RungResult])
    decode_digests: dict[str, str] = field(default_factory=dict[str, str])


Item = tuple[str, Op, QuantType, "torch.Tensor | None"]
"""One weight of the ladder: name, ``q.weight`` op, descriptor, rung 3's input (``None``: not a linear)."""

Checked = tuple[RungResult, str, list[RungResult], list[RungResult]]
"""Rung 1's row, the decode's digest, rung 2's rows, rung 3's rows."""


def ladder(
    m: Module,
    effective: Mapping[str, torch.Tensor | np.ndarray] | None,
    float_weights: Mapping[str, torch.Tensor] | None = None,
    *,
    rows: int = 4,
    seed: int = 0,
    jobs: int = 1,
    proofs: Proofs | None = None,
    digest: str = DECODE_DIGEST,
) -> Ladder:
    """``rung1_pack_unpack``, ``rung2_reconstruction`` (when ``effective`` is given) and
    ``rung3_operators`` weight by weight (``2 * jobs`` weights in flight at most), in ``jobs``
    threads; the same rows, order and seeded inputs as the three functions for any ``jobs``.
    ``effective`` may state ``same_bound_bytes(name, m, op, t)``: that weight is the reference's own
    bytes, and rung 2 holds without a decode. ``proofs``: facts the compile proved on these bytes
    (``qcompiler.proofs``); a weight they cover is not decoded again. ``digest``: the manifest field
    whose digest of each decode is computed (``decode_digest.DIGESTS``; an older artifact's)."""
    items: list[Item] = []
    for name, op, t in weights(m):
        linear = t.req == "linear" and t.rank == 2
        items.append((name, op, t, rung3_input(name, int(t.shape[1]), rows, seed) if linear else None))

    def one(item: Item) -> Checked:
        name, op, t, x = item
        same_as = getattr(effective, "same_bound_bytes", None)
        same = bool(callable(same_as) and same_as(name, m, op, t))
        known = recorded(proofs if digest == DECODE_DIGEST else None, m, item, effective, same)
        if known is not None:
            return known
        if row_blocks.huge(t, LADDER_BLOCK):
            ok, hexdigest, r2, r3 = check_rows(m, op, t, name, x, effective, float_weights, same, digest)
            return rung1_row(name, t, ok), hexdigest, r2, r3
        return check_whole(m, item, effective, float_weights, same, digest)

    out = Ladder()
    for (name, _, _, _), (r1, hexdigest, r2, r3) in zip(items, ordered_map(one, items, jobs), strict=True):
        out.r1.append(r1)
        out.decode_digests[name] = hexdigest
        out.r2 += r2
        out.r3 += r3
    return out


def check_whole(
    m: Module,
    item: Item,
    effective: Mapping[str, Any] | None,
    float_weights: Mapping[str, Any] | None,
    same: bool,
    digest: str = DECODE_DIGEST,
) -> Checked:
    """The ladder of one weight decoded whole."""
    name, op, t, x = item
    p = needed_parts(m, op, t)
    codes = p["codes"]
    assert isinstance(codes, np.ndarray)
    ok, logical = pack_round_trip(codes, t, p)
    got = decoded(m, op, t, logical)
    del logical
    n = int(got.shape[0]) if got.ndim else 0
    ev = DecodeEvidence(x, n, row_reader(float_weights, name), digest)
    ev.add(0, n, got)
    r2: list[RungResult] = []
    if same:
        r2.append(RungResult(2, name, True, "", {"max_abs_diff": 0.0}))
    elif effective is not None:
        r2 += rung2_reconstruction(single(m, op), effective, {name: got})
    metrics = ev.rung3()
    r3 = [] if metrics is None else [RungResult(3, name, True, "", metrics)]
    return rung1_row(name, t, ok), ev.digest(), r2, r3


def recorded(
    proofs: Proofs | None, m: Module, item: Item, effective: Mapping[str, Any] | None, same: bool
) -> Checked | None:
    """The weight's rungs from the facts proven on the same bytes during the compile
    (``qcompiler.proofs``), or ``None`` when they do not cover it (then it is checked here)."""
    name, op, t, x = item
    if proofs is None or (effective is not None and not same):
        return None
    found = proofs.lookup(key_of(m, name, op, t))
    if found is None:
        return None
    fact, packed = found
    if not (packed or t.pack.family == "logical") or (x is not None and fact.rung3 is None):
        return None
    r2 = [RungResult(2, name, True, "", {"max_abs_diff": 0.0})] if same else []
    r3 = [] if x is None or fact.rung3 is None else [RungResult(3, name, True, "", dict(fact.rung3))]
    return rung1_row(name, t, True), fact.digest, r2, r3


def single(m: Module, op: Op) -> Module:
    """A view of ``m`` whose only op is ``op`` (for the per-weight rung functions)."""
    g = Graph("weight")
    g.ops = [op]
    return Module(m.name, tensors=m.tensors, graphs=[g], attrs=m.attrs, base_dir=m.base_dir)

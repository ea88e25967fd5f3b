"""The calibrated allocation of ``mixed-2416``: measured options per weight, one exact knapsack.

With calibration text the rate is spent where the *model* measurably loses least, not where a
per-group error model says. ``allocate_measured``:

1. starts from the layer-level allocation (``allocate_layers``: whole weights 4-bit by importance),
   quantized, as the context every measurement is made in, so each weight is judged with the rest of
   the model as quantized as it will roughly be (errors of different weights do not add up exactly);
2. gives every weight a few options, the fraction ``f`` in ``FRACTIONS`` of its rows 4-bit (the rows
   of largest summed group gain, ``mixprec_alloc.group_gains``): a row is the map's cheap unit, one
   ``wide_rows`` entry whatever K, so a whole 4-bit weight costs about what a uniform one does;
3. encodes each option round-to-nearest (Hessian-diagonal weighted: the GPTQ encoding fits the
   calibration tokens, so its calibration loss flatters it) and measures the model's loss on each
   calibration text with that weight alone at that option, the rest at the context (``Measure``),
   scored by the mean over the worst ``TAIL`` of the texts (``tail_mean``): what is judged is how
   badly the worst inputs degrade, not the average, so one weight cannot buy a lower mean with a
   few texts ruined (on MiniLM at 3.0 bits the worst quarter beat the plain mean on every minimum:
   docs/mixprec.md section 5);
4. picks one option per weight minimising the sum of measured losses within the bit budget (an exact
   multiple-choice knapsack over bits rounded up to ``UNITS`` steps, so the budget always holds);
5. encodes the picks with GPTQ error feedback (full Hessian) and the outliers asked for.

The layer-level options (``f`` 0 or 1 for every weight) are among the candidates, measured the same
way, so the knapsack's predicted loss is never above the layer-level allocation's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import NDArray

from qcompiler.quant.mixprec import MixedQuant, MixedQuantError, rate_bits
from qcompiler.quant.mixprec_alloc import diag_of, encode_mask, group_gains, outlier_cap, prepared_weights
from qcompiler.quant.mixprec_fit import DAMP, encode_rtn, pick_outliers

F64 = NDArray[np.float64]
Mask = NDArray[np.bool_]

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
"""Fractions of a weight's rows that may be 4-bit (its options)."""
UNITS = 1 << 14
"""Steps the knapsack splits the bits above all-2-bit into (each option's cost rounded up to one)."""

TAIL = 0.25
"""The fraction of the calibration texts, the worst first, whose mean loss scores an option."""

Measure = Callable[[Mapping[str, torch.Tensor]], Sequence[float] | NDArray[np.float64]]
"""The model's loss on each calibration text with the named weights replaced by these float decodes
(every other weight as it is); lower is better."""


def tail_mean(losses: Sequence[float] | NDArray[np.float64], fraction: float = TAIL) -> float:
    """The mean of the largest ``ceil(fraction * n)`` of ``n`` losses (at least one)."""
    x = np.sort(np.asarray(losses, dtype=np.float64).reshape(-1))[::-1]
    if x.size == 0:
        raise MixedQuantError(
            "has no calibration text to measure on", field="calibration", expected=">= 1 text", found=0
        )
    return float(x[: max(1, math.ceil(fraction * x.size))].mean())


@dataclass(frozen=True)
class Option:
    """One candidate of one weight: its 4-bit rows, its all-in bits and its measured loss."""

    is4: Mask
    nnz: int
    bits: int
    loss: float


def row_masks(gain: F64, fractions: tuple[float, ...] = FRACTIONS) -> list[Mask]:
    """``[N, K/G]`` masks, one per fraction: that fraction of the rows (largest summed gain first,
    ties to the lower row) entirely 4-bit. Duplicates (a few rows) are dropped."""
    n, ng = gain.shape
    order = np.argsort(-gain.sum(axis=1), kind="stable")
    out: list[Mask] = []
    seen: set[int] = set()
    for f in fractions:
        r = round(f * n)
        if r in seen:
            continue
        seen.add(r)
        mask = np.zeros((n, ng), dtype=np.bool_)
        mask[order[:r]] = True
        out.append(mask)
    return out


def knapsack(costs: list[list[int]], losses: list[list[float]], budget: int) -> list[int]:
    """The option of each item minimising the summed loss with the summed cost at most ``budget``
    (exact over costs rounded up to ``UNITS`` steps of the room above the cheapest options; ties: the
    earlier option). Raises when even the cheapest options exceed the budget."""
    base = sum(min(c) for c in costs)
    room = budget - base
    if room < 0:
        raise MixedQuantError(
            "is below the cheapest allocation", field="rate", expected=f">= {base} bits", found=budget
        )
    unit = max(1, -(-room // UNITS))
    cap = room // unit
    best = np.full(cap + 1, np.inf)
    best[0] = 0.0
    picks: list[NDArray[np.int64]] = []
    for cost, loss in zip(costs, losses, strict=True):
        low = min(cost)
        new, arg = np.full(cap + 1, np.inf), np.full(cap + 1, -1, dtype=np.int64)
        for i, (c, value) in enumerate(zip(cost, loss, strict=True)):
            steps = -(-(c - low) // unit)
            if steps > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[steps:] = best[: cap + 1 - steps] + value
            better = cand < new
            new[better], arg[better] = cand[better], i
        picks.append(arg)
        best = new
    at = int(np.argmin(best))
    chosen: list[int] = []
    for cost, arg in zip(reversed(costs), reversed(picks), strict=True):
        i = int(arg[at])
        chosen.append(i)
        at -= -(-(cost[i] - min(cost)) // unit)
    return chosen[::-1]


def allocate_measured(
    weights: Mapping[str, torch.Tensor],
    rate: float,
    *,
    hessians: Mapping[str, torch.Tensor],
    context: Mapping[str, torch.Tensor],
    measure: Measure,
    group: int = 64,
    group2: int = 64,
    outliers: float = 0.0,
    damp: float = DAMP,
    fractions: tuple[float, ...] = FRACTIONS,
    gains: Mapping[str, F64] | None = None,
    tail: float = TAIL,
) -> dict[str, MixedQuant]:
    """Every weight mixed at most ``rate`` bits/weight over the model, by measurement (the module
    docstring). ``context``: each weight's float decode at the starting (layer-level) allocation;
    ``measure``: the model's loss on each text with some weights replaced, scored by ``tail_mean``
    over the worst ``tail`` of them; ``gains``: each weight's ``group_gains`` computed beforehand (to
    reuse across rates)."""
    prepared = prepared_weights(weights, group, group2, hessians)
    total = math.floor(rate * sum(x.size for x, _ in prepared.values()))
    options: dict[str, list[Option]] = {}
    for name, (x, h) in prepared.items():
        n, k = x.shape
        hw = diag_of(h)
        options[name] = []
        gain = group_gains(x, h, group, group2, damp) if gains is None else np.asarray(gains[name], np.float64)
        for is4 in row_masks(gain, fractions):
            nnz = min(round(outliers * n * k), outlier_cap(n, k, group, int(is4.sum())))
            q = encode_rtn(x, is4, pick_outliers(x, is4, hw, group, nnz), hw, group, group2)
            loss = tail_mean(measure({**context, name: torch.from_numpy(q.decode())}), tail)
            rows4 = int(is4.all(axis=1).sum())
            bits = rate_bits(n, k, group, group2, int(is4.sum()), nnz, rows4)
            options[name].append(Option(is4, nnz, bits, loss))
    names = list(options)
    chosen = knapsack(
        [[o.bits for o in options[nm]] for nm in names], [[o.loss for o in options[nm]] for nm in names], total
    )
    result: dict[str, MixedQuant] = {}
    for name, i in zip(names, chosen, strict=True):
        x, h = prepared[name]
        pick = options[name][i]
        result[name] = encode_mask(x, h, pick.is4, pick.nnz, group, group2, damp)
    return result

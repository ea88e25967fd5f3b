"""The measured allocation of mixed-2416 (qcompiler/quant/mixprec_search.py): its knapsack is exact, its
options are whole 4-bit rows, it measures each option once, scores it by the worst calibration texts,
keeps the rate and is deterministic."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import numpy as np
import pytest
import torch

from qcompiler.quant.mixprec import MixedQuantError
from qcompiler.quant.mixprec_search import TAIL, Measure, allocate_measured, knapsack, row_masks, tail_mean


def brute(costs: list[list[int]], losses: list[list[float]], budget: int) -> float:
    best = math.inf
    for pick in itertools.product(*[range(len(c)) for c in costs]):
        if sum(c[i] for c, i in zip(costs, pick, strict=True)) <= budget:
            best = min(best, sum(v[i] for v, i in zip(losses, pick, strict=True)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_knapsack_is_exact_and_keeps_the_budget(seed: int) -> None:
    rng = np.random.default_rng(seed)
    costs = [sorted(int(c) for c in rng.integers(100, 5000, size=3)) for _ in range(5)]
    losses = [sorted((float(v) for v in rng.random(3)), reverse=True) for _ in range(5)]
    budget = sum(min(c) for c in costs) + int(rng.integers(0, 8000))
    pick = knapsack(costs, losses, budget)
    assert sum(c[i] for c, i in zip(costs, pick, strict=True)) <= budget
    got = sum(v[i] for v, i in zip(losses, pick, strict=True))
    assert got == pytest.approx(brute(costs, losses, budget))  # costs below UNITS steps: exact


def test_knapsack_refuses_a_budget_below_the_cheapest_options() -> None:
    with pytest.raises(MixedQuantError, match="rate: is below the cheapest allocation"):
        knapsack([[10, 20], [5, 9]], [[1.0, 0.0], [1.0, 0.0]], 14)


def test_row_masks_take_whole_rows_by_summed_gain() -> None:
    gain = np.array([[1.0, 1.0], [5.0, 0.0], [0.5, 0.5], [3.0, 3.0]])
    masks = row_masks(gain, (0.0, 0.25, 0.5, 1.0))
    assert [int(m.all(axis=1).sum()) for m in masks] == [0, 1, 2, 4]
    assert all(bool((m.all(axis=1) == m.any(axis=1)).all()) for m in masks)  # rows are all or nothing
    assert masks[1][3].all()  # row 3 (6.0) first
    assert masks[2][[3, 1]].all()  # then row 1 (5.0)


def weights_and_hessians() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    weights = {f"w{i}": torch.randn(32, 128, generator=gen) * (1 + i) for i in range(3)}
    hessians = {}
    for name in weights:
        x = torch.randn(256, 128, generator=gen, dtype=torch.float64)
        hessians[name] = x.T @ x
    return weights, hessians


def test_measured_allocation_keeps_the_rate_with_whole_rows() -> None:
    weights, hessians = weights_and_hessians()
    calls: list[dict[str, float]] = []

    def measure(decodes: Mapping[str, torch.Tensor]) -> list[float]:  # a stand-in model: the summed errors
        errs = {n: float(((d.double() - weights[n].double()) ** 2).sum()) for n, d in decodes.items()}
        calls.append(errs)
        return [sum(errs.values())]

    context = {n: torch.zeros_like(w) for n, w in weights.items()}
    measured: Measure = measure
    rate = 3.0
    quants = allocate_measured(weights, rate, hessians=hessians, context=context, measure=measured, group=64)
    total = sum(w.numel() for w in weights.values())
    assert sum(q.rate_bits() for q in quants.values()) <= math.floor(rate * total)
    assert len(calls) == 3 * 5  # every weight, every fraction, once
    for q in quants.values():  # whole rows: nothing spelled out group by group
        assert q.wide.shape[0] == 0
    again = allocate_measured(weights, rate, hessians=hessians, context=context, measure=measured, group=64)
    for name, q in quants.items():  # deterministic
        assert np.array_equal(q.codes, again[name].codes)
        assert np.array_equal(q.wide_rows, again[name].wide_rows)


def test_tail_mean_is_the_mean_of_the_worst_texts() -> None:
    assert TAIL == 0.25
    assert tail_mean([1.0, 4.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]) == pytest.approx(3.5)  # 2 of 8
    assert tail_mean([1.0, 4.0, 2.0]) == pytest.approx(4.0)  # ceil(0.75): the worst one
    assert tail_mean([1.0, 4.0, 2.0], 1.0) == pytest.approx(7.0 / 3.0)  # the plain mean
    assert tail_mean(np.array([5.0])) == 5.0
    with pytest.raises(MixedQuantError, match="calibration: has no calibration text"):
        tail_mean([])


def test_the_worst_texts_decide_not_the_mean() -> None:
    """Weight a ruins one text of eight, b spreads as much damage over seven: the mean weighs them
    alike, the worst quarter (that text and one more) weighs a seven times, so a gets more 4-bit rows
    scored by the tail than by the mean."""
    gen = torch.Generator().manual_seed(1)
    weights = {n: torch.randn(64, 128, generator=gen) for n in ("a", "b")}
    hessians = {n: torch.eye(128, dtype=torch.float64) for n in weights}

    def measure(decodes: Mapping[str, torch.Tensor]) -> list[float]:
        err = {n: float(((d.double() - weights[n].double()) ** 2).sum()) for n, d in decodes.items()}
        return [7.0 * err["a"]] + [err["b"]] * 7

    context = {n: w.clone() for n, w in weights.items()}  # each weight measured with the other float
    rows = {}
    for tail in (1.0, TAIL):
        quants = allocate_measured(
            weights, 3.0, hessians=hessians, context=context, measure=measure, group=64, tail=tail
        )
        rows[tail] = {n: q.wide_rows.shape[0] for n, q in quants.items()}
    assert rows[TAIL]["a"] > rows[1.0]["a"]

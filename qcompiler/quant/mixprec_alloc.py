"""Choosing the 4-bit groups and the outliers of the mixed 2/4/16-bit representation.

- ``quantize_mixed``: one weight at a target all-in rate (or an explicit ``Budget``);
- ``allocate_mixed``: every weight of a model at one total rate, the 4-bit groups going wherever
  their (importance-scaled) error reduction per bit is largest, whichever weight holds them;
- ``allocate_layers``: the layer-level baseline, each whole weight uniform 2-bit or 4-bit.

Sensitivity is a group's squared error at 2 bits minus at 4 bits, each column weighted by the
Hessian diagonal (the sum of ``x_k ** 2`` over calibration activations) when one is given. A full
``[K, K]`` Hessian (``X^T X``) also turns on GPTQ-style error feedback in the encoding, and then
``allocate_mixed`` keeps each weight's total (the value ``allocate_layers`` ranks that weight by) but
spreads it over the groups by the loss reduction the GPTQ encoder itself reaches (all-2-bit minus
all-4-bit, per group), not by round-to-nearest errors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import NDArray

from qcompiler.quant.mixprec import (
    MixedQuant,
    MixedQuantError,
    check_hessian,
    check_weight,
    rate_bits,
    uniform_rate_bits,
)
from qcompiler.quant.mixprec_fit import DAMP, encode_gptq, encode_gptq_loss, encode_rtn, group_errors, pick_outliers

F64 = NDArray[np.float64]

DEFAULT_OUTLIERS = 0.005
"""Outliers as a fraction of a weight's elements."""


@dataclass(frozen=True)
class Budget:
    """An explicit allocation for one weight: ``n4`` 4-bit groups and ``nnz`` outliers."""

    n4: int
    nnz: int


def diag_of(h: F64 | None) -> F64 | None:
    return None if h is None else (h if h.ndim == 1 else np.diagonal(h).copy())


def extra_costs(n: int, k: int, group: int) -> tuple[int, int]:
    """Extra bits of one 4-bit group (its codes and ``wide`` entry) and of one outlier."""
    wide_bits = 16 if n * (k // group) <= 32767 else 32
    return 2 * group + wide_bits, (16 if k <= 32767 else 32) + 16


def outlier_cap(n: int, k: int, group: int, n4: int) -> int:
    """Most outliers the 2-bit groups can hold (``G // 8`` each)."""
    return (n * (k // group) - n4) * (group // 8)


def budget_for_rate(n: int, k: int, group: int, group2: int, rate: float, outliers: float) -> Budget:
    """The outliers asked for (a fraction of ``N K``, as many as fit), then as many 4-bit groups as the
    rest of ``rate * N * K`` bits pays for. Raises when even all-2-bit exceeds the rate."""
    total = math.floor(rate * n * k)
    base = rate_bits(n, k, group, group2, 0, 0)
    if base > total:
        found = f"{rate}, all-2-bit needs {base / (n * k):.4f}"
        raise MixedQuantError(
            "is below the all-2-bit rate", field="rate", expected=f">= {base / (n * k):.4f}", found=found
        )
    group_cost, outlier_cost = extra_costs(n, k, group)
    nnz = min(round(outliers * n * k), (total - base) // outlier_cost)
    n4 = min((total - base - nnz * outlier_cost) // group_cost, n * (k // group))
    return Budget(n4=n4, nnz=min(nnz, outlier_cap(n, k, group, n4)))


def _check_budget(budget: Budget, n: int, k: int, group: int) -> None:
    groups = n * (k // group)
    if not 0 <= budget.n4 <= groups:
        raise MixedQuantError("out of range", field="budget.n4", expected=f"0..{groups}", found=budget.n4)
    cap = outlier_cap(n, k, group, budget.n4)
    if not 0 <= budget.nnz <= cap:
        raise MixedQuantError("out of range", field="budget.nnz", expected=f"0..{cap}", found=budget.nnz)


def _top(gain: F64, count: int) -> NDArray[np.bool_]:
    """Mask of the ``count`` largest entries (ties: the lower flat index first)."""
    mask = np.zeros(gain.size, dtype=np.bool_)
    mask[np.argsort(-gain.reshape(-1), kind="stable")[:count]] = True
    return mask.reshape(gain.shape)


def encode_mask(
    x: F64, h: F64 | None, is4: NDArray[np.bool_], nnz: int, group: int, group2: int, damp: float
) -> MixedQuant:
    """Outliers picked in the 2-bit groups, then GPTQ (full Hessian) or round-to-nearest."""
    hw = diag_of(h)
    out = pick_outliers(x, is4, hw, group, nnz)
    if h is not None and h.ndim == 2:
        return encode_gptq(x, h, is4, out, group, group2, damp)
    return encode_rtn(x, is4, out, hw, group, group2)


def quantize_mixed(
    w: torch.Tensor,
    *,
    group: int = 64,
    group2: int = 64,
    rate: float = 3.0,
    outliers: float = DEFAULT_OUTLIERS,
    hessian: torch.Tensor | None = None,
    budget: Budget | None = None,
    damp: float = DAMP,
) -> MixedQuant:
    """Quantize one weight ``[N, K]`` to at most ``rate`` bits/weight all-in (``rate_bits``), or to an
    explicit ``budget``: the groups whose error drops most from 2 to 4 bits get 4 bits; ``outliers``
    (a fraction of the elements) are kept 16-bit in 2-bit groups. ``hessian``: ``[K]`` diagonal
    (weights the errors) or ``[K, K]`` (also GPTQ error feedback, damped by ``damp`` times its mean
    diagonal). Deterministic."""
    x = check_weight(w, group, group2)
    n, k = x.shape
    h = check_hessian(hessian, k)
    if budget is None:
        budget = budget_for_rate(n, k, group, group2, rate, outliers)
    _check_budget(budget, n, k, group)
    err2, err4 = group_errors(x, diag_of(h), group, group2)
    return encode_mask(x, h, _top(err2 - err4, budget.n4), budget.nnz, group, group2, damp)


def group_gains(x: F64, h: F64 | None, group: int, group2: int, damp: float = DAMP) -> F64:
    """Each group's error reduction from 2 to 4 bits ``[N, ng]``: the Hessian-weighted round-to-nearest
    one, or with a full Hessian that total spread over the groups by their GPTQ loss reduction."""
    err2, err4 = group_errors(x, diag_of(h), group, group2)
    gain = err2 - err4
    if h is None or h.ndim != 2:
        return gain
    n, k = x.shape
    none = np.zeros((n, k), dtype=np.bool_)
    loss2 = encode_gptq_loss(x, h, np.zeros(gain.shape, dtype=np.bool_), none, group, group2, damp)[1]
    loss4 = encode_gptq_loss(x, h, np.ones(gain.shape, dtype=np.bool_), none, group, group2, damp)[1]
    share = np.maximum(loss2 - loss4, 0.0)
    if float(share.sum()) <= 0.0:
        return gain
    return share * (float(gain.sum()) / float(share.sum()))


def prepared_weights(
    weights: Mapping[str, torch.Tensor], group: int, group2: int, hessians: Mapping[str, torch.Tensor] | None
) -> dict[str, tuple[F64, F64 | None]]:
    """Each weight checked (float64) with its checked Hessian, if any."""
    out: dict[str, tuple[F64, F64 | None]] = {}
    for name, w in weights.items():
        x = check_weight(w, group, group2)
        out[name] = (x, check_hessian(None if hessians is None else hessians.get(name), x.shape[1]))
    return out


def allocate_mixed(
    weights: Mapping[str, torch.Tensor],
    rate: float,
    *,
    group: int = 64,
    group2: int = 64,
    outliers: float = DEFAULT_OUTLIERS,
    hessians: Mapping[str, torch.Tensor] | None = None,
    importance: Mapping[str, float] | None = None,
    damp: float = DAMP,
    gains: Mapping[str, F64] | None = None,
) -> dict[str, MixedQuant]:
    """Every weight mixed, the model's all-in bits at most ``rate`` times its weights: each weight keeps
    ``outliers`` of its elements 16-bit, and the 4-bit groups go, across all weights, by error reduction
    (``group_gains`` times the weight's ``importance``, default 1) per bit, largest first; a whole
    weight goes 4-bit when all its groups win. Deterministic (ties: the earlier weight, the lower
    group). ``gains``: each weight's ``group_gains`` computed beforehand (to reuse across rates)."""
    prepared = prepared_weights(weights, group, group2, hessians)
    names = list(prepared)
    total = math.floor(rate * sum(x.size for x, _ in prepared.values()))
    scaled: list[F64] = []
    costs: list[F64] = []
    nnzs: dict[str, int] = {}
    for name in names:
        x, h = prepared[name]
        n, k = x.shape
        group_cost = extra_costs(n, k, group)[0]
        nnzs[name] = min(round(outliers * n * k), outlier_cap(n, k, group, 0))
        total -= rate_bits(n, k, group, group2, 0, nnzs[name])
        gain = group_gains(x, h, group, group2, damp) if gains is None else np.asarray(gains[name], np.float64)
        if gain.shape != (n, k // group):
            raise MixedQuantError(
                "one gain per group", field=f"gains[{name}]", expected=(n, k // group), found=gain.shape
            )
        scaled.append(gain.reshape(-1) * (1.0 if importance is None else importance[name]))
        costs.append(np.full(gain.size, float(group_cost)))
    if total < 0:
        raise MixedQuantError("is below the all-2-bit rate of these weights", field="rate", expected="more", found=rate)
    gain, cost = np.concatenate(scaled), np.concatenate(costs)
    order = np.argsort(-gain / cost, kind="stable")
    chosen = np.zeros(gain.size, dtype=np.bool_)
    chosen[order[np.cumsum(cost[order]) <= total]] = True
    result: dict[str, MixedQuant] = {}
    start = 0
    for name in names:
        x, h = prepared[name]
        n, k = x.shape
        is4 = chosen[start : start + n * (k // group)].reshape(n, k // group)
        start += is4.size
        nnz = min(nnzs[name], outlier_cap(n, k, group, int(is4.sum())))
        result[name] = encode_mask(x, h, is4, nnz, group, group2, damp)
    return result


def allocate_layers(
    weights: Mapping[str, torch.Tensor],
    rate: float,
    *,
    group: int = 64,
    group2: int = 64,
    hessians: Mapping[str, torch.Tensor] | None = None,
    importance: Mapping[str, float] | None = None,
    damp: float = DAMP,
    stored: bool = False,
) -> dict[str, MixedQuant]:
    """The layer-level baseline: each whole weight uniform 2-bit or 4-bit (no outliers), the weights
    going to 4 bits by error reduction (times ``importance``) per bit, largest first, while the total
    stays at most ``rate`` times the weights. The total counts ``uniform_rate_bits`` (no ``wide`` list
    or CSR charged: what a uniform weight stores), or with ``stored`` what the weights store as
    ``mixprec`` (their map and row pointers too: what an artifact of them holds)."""
    prepared = prepared_weights(weights, group, group2, hessians)
    total = math.floor(rate * sum(x.size for x, _ in prepared.values()))

    def cost(n: int, k: int, bits: int) -> int:
        if stored:
            return rate_bits(n, k, group, group2, n * (k // group) if bits == 4 else 0, 0)
        return uniform_rate_bits(n, k, group, group2, bits)

    used = 0
    scores: list[tuple[float, str]] = []
    for name, (x, h) in prepared.items():
        n, k = x.shape
        used += cost(n, k, 2)
        err2, err4 = group_errors(x, diag_of(h), group, group2)
        gain = float((err2 - err4).sum()) * (1.0 if importance is None else importance[name])
        scores.append((-gain / (cost(n, k, 4) - cost(n, k, 2)), name))
    wide: set[str] = set()
    for _, name in sorted(scores):
        n, k = prepared[name][0].shape
        extra = cost(n, k, 4) - cost(n, k, 2)
        if used + extra <= total:
            used += extra
            wide.add(name)
    result: dict[str, MixedQuant] = {}
    for name, (x, h) in prepared.items():
        n, k = x.shape
        is4 = np.full((n, k // group), name in wide)
        result[name] = encode_mask(x, h, is4, 0, group, group2, damp)
    return result

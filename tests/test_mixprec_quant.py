"""The mixed 2/4/16-bit quantizer: the decode formula, the all-in rate, the invariants of its arrays
(code ranges per group width, outliers only in 2-bit groups and coded as the zero point, sorted
``wide``), determinism, typed errors, and that it beats the layer-level baseline at the same rate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qcompiler.errors import QcError
from qcompiler.ir.mixprec import map_problem
from qcompiler.quant.mixprec import MixedQuant, MixedQuantError, rate_bits, uniform_rate_bits
from qcompiler.quant.mixprec_alloc import Budget, allocate_layers, allocate_mixed, group_gains, quantize_mixed

ARRAYS = ("codes", "zero", "scale_codes", "scale2", "zero2", "wide", "wide_rows", "rowptr", "col", "value")


def heavy_weight(n: int = 96, k: int = 128, seed: int = 0) -> torch.Tensor:
    """A seeded random weight with a few rows ten times heavier and a few spikes."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[[3, n // 2, n - 5]] *= 10.0
    w[torch.randint(0, n, (20,), generator=g), torch.randint(0, k, (20,), generator=g)] = 0.3
    return w


def calibration(k: int = 128, tokens: int = 512, seed: int = 1) -> torch.Tensor:
    """Seeded activations ``[tokens, K]`` with uneven channel scales."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, k, generator=g) * torch.linspace(0.2, 3.0, k)


def stored_bits(q: MixedQuant) -> int:
    """The bits the arrays hold: codes at their group's width, every other array at its dtype's width."""
    code_bits = int(q.group_bits().sum()) * q.group
    others = (q.zero, q.scale_codes, q.scale2, q.zero2, q.wide, q.wide_rows, q.rowptr, q.col, q.value)
    return code_bits + sum(8 * a.nbytes for a in others)


def test_worked_example_decodes_to_one() -> None:
    q = MixedQuant(
        codes=np.full((1, 16), 3, dtype=np.uint8),
        zero=np.array([[2]], dtype=np.uint8),
        scale_codes=np.array([[5]], dtype=np.uint8),
        scale2=np.array([[0.25]], dtype=np.float16),
        zero2=np.array([[1]], dtype=np.uint8),
        wide=np.zeros(0, dtype=np.int16),
        wide_rows=np.zeros(0, dtype=np.int16),
        rowptr=np.zeros(2, dtype=np.int32),
        col=np.zeros(0, dtype=np.int16),
        value=np.zeros(0, dtype=np.float16),
        group=16,
        group2=64,
    )
    assert q.scales().tolist() == [[1.0]]
    assert q.decode().tolist() == [[1.0] * 16]


@pytest.mark.parametrize("hessian", [None, "diag", "full"])
def test_arrays_keep_every_rule(hessian: str | None) -> None:
    w = heavy_weight()
    x = calibration()
    h = {None: None, "diag": (x * x).sum(0), "full": x.T @ x}[hessian]
    q = quantize_mixed(w, group=32, group2=64, rate=3.2, outliers=0.01, hessian=h)
    n, k = q.shape
    assert q.rate_bits() == stored_bits(q) == rate_bits(n, k, 32, 64, q.n4, q.nnz, q.wide_rows.shape[0])
    assert q.rate_bits() <= 3.2 * n * k
    assert q.n4 > 0
    assert q.nnz > 0
    assert (q.wide.dtype, q.col.dtype, q.rowptr.dtype) == (np.int16, np.int16, np.int16)
    assert bool(np.all(np.diff(q.wide.astype(np.int64)) > 0))
    bits = q.group_bits()
    qmax = np.where(bits == 4, 15, 3)
    assert bool(np.all(q.zero <= qmax))
    assert bool(np.all(q.codes.reshape(n, k // 32, 32) <= qmax[..., None]))
    assert q.scale2.shape == q.zero2.shape == (2, k // 32)  # 96 rows: a block of 64 and a short one
    assert (q.rowptr[0], q.rowptr[-1]) == (0, q.nnz)
    assert bool(np.all(np.diff(q.rowptr) >= 0))
    rows = np.repeat(np.arange(n), np.diff(q.rowptr))
    cols = q.col.astype(np.int64)
    for r in range(n):
        assert bool(np.all(np.diff(cols[rows == r]) > 0))
    assert bool(np.all(bits[rows, cols // 32] == 2))
    assert bool(np.all(q.codes[rows, cols] == q.zero[rows, cols // 32]))
    assert q.decode()[rows, cols].tolist() == q.value.astype(np.float32).tolist()


def test_codes_round_against_the_decoded_scales() -> None:
    w = heavy_weight()
    q = quantize_mixed(w, group=32, rate=3.0, outliers=0.0)
    n, k = q.shape
    qmax = np.where(q.group_bits() == 4, 15.0, 3.0)[..., None]
    s1 = q.scales().astype(np.float64)[..., None]
    z = q.zero.astype(np.float64)[..., None]
    again = np.clip(np.rint(w.double().numpy().reshape(n, k // 32, 32) / s1) + z, 0, qmax)
    assert bool(np.all(again.reshape(n, k) == q.codes))


def test_deterministic() -> None:
    w, x = heavy_weight(), calibration()
    for h in (None, x.T @ x):
        a = quantize_mixed(w, group=32, rate=3.0, hessian=h)
        b = quantize_mixed(w.clone(), group=32, rate=3.0, hessian=None if h is None else h.clone())
        for name in ARRAYS:
            left, right = getattr(a, name), getattr(b, name)
            assert (left.dtype, left.tobytes()) == (right.dtype, right.tobytes()), name


@pytest.mark.parametrize("rate", [2.6, 2.75, 3.0, 3.5, 5.0])
def test_realized_rate_within_target(rate: float) -> None:
    w = heavy_weight(64, 256)
    q = quantize_mixed(w, group=64, rate=rate)
    assert q.rate_bits() <= rate * w.numel()
    weights = {"a": w, "b": heavy_weight(32, 128, seed=3)}
    total = sum(q.rate_bits() for q in allocate_mixed(weights, rate, group=64).values())
    assert total <= rate * sum(v.numel() for v in weights.values())
    layers = allocate_layers(weights, rate, group=64)
    used = sum(uniform_rate_bits(*q.shape, 64, 64, 4 if q.n4 else 2) for q in layers.values())
    assert used <= rate * sum(v.numel() for v in weights.values())
    assert all(q.nnz == 0 and q.n4 in (0, q.group_bits().size) for q in layers.values())


def test_beats_layer_baseline_at_same_rate() -> None:
    w = heavy_weight()
    mixed = quantize_mixed(w, group=32, rate=3.0)
    layer = allocate_layers({"w": w}, 3.0, group=32)["w"]
    err_mixed = float(((mixed.decode() - w.numpy()) ** 2).sum())
    err_layer = float(((layer.decode() - w.numpy()) ** 2).sum())
    assert mixed.rate_bits() <= 3.0 * w.numel()
    assert err_mixed < 0.7 * err_layer


def test_error_feedback_lowers_output_error() -> None:
    w, x = heavy_weight(), calibration()
    rtn = quantize_mixed(w, group=32, rate=3.0, hessian=(x * x).sum(0))
    gptq = quantize_mixed(w, group=32, rate=3.0, hessian=x.T @ x)
    out = x @ w.T

    def err(q: MixedQuant) -> float:
        return float(((x @ torch.from_numpy(q.decode()).T - out) ** 2).sum())

    assert err(gptq) < err(rtn)


def test_gptq_gains_keep_the_weights_total_and_drive_the_allocation() -> None:
    w, x = heavy_weight(), calibration()
    h = (x.T @ x).double().numpy()
    rtn = group_gains(w.double().numpy(), np.diagonal(h).copy(), 32, 64)
    gptq = group_gains(w.double().numpy(), h, 32, 64)
    assert gptq.shape == rtn.shape == (96, 4)
    assert bool(np.all(gptq >= 0))
    assert float(gptq.sum()) == pytest.approx(float(rtn.sum()), rel=1e-9)
    assert not np.allclose(gptq, rtn)
    weights = {"a": w, "b": heavy_weight(32, 128, seed=3)}
    hs = {"a": x.T @ x, "b": x.T @ x}
    given = {n: group_gains(v.double().numpy(), hs[n].double().numpy(), 32, 64) for n, v in weights.items()}
    first = allocate_mixed(weights, 3.0, group=32, outliers=0.0, hessians=hs)
    again = allocate_mixed(weights, 3.0, group=32, outliers=0.0, hessians=hs, gains=given)
    for name in weights:
        assert first[name].wide.tobytes() == again[name].wide.tobytes()
        assert first[name].rowptr.dtype == np.int16
    with pytest.raises(MixedQuantError) as info:
        allocate_mixed(weights, 3.0, group=32, hessians=hs, gains={**given, "b": np.zeros(3)})
    assert info.value.field == "gains[b]"


def test_all_4_bit_is_reachable_by_the_mixed_allocator() -> None:
    weights = {"a": heavy_weight(), "b": heavy_weight(32, 128, seed=3)}
    quants = allocate_mixed(weights, 3.5, group=32, outliers=0.0, importance={"a": 1.0, "b": 1e6})
    assert 0 < quants["a"].n4 < quants["a"].group_bits().size
    assert quants["b"].n4 == quants["b"].group_bits().size


def test_rowptr_widens_past_32767_outliers() -> None:
    assert rate_bits(8, 64, 32, 64, 0, 32768) - rate_bits(8, 64, 32, 64, 0, 32767) == 16 * 9 + 32


def test_explicit_budget_is_kept() -> None:
    q = quantize_mixed(heavy_weight(), group=32, budget=Budget(n4=10, nnz=7))
    assert (q.n4, q.nnz) == (10, 7)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"w": torch.zeros(4)}, "w.shape"),
        ({"w": torch.zeros(4, 64, dtype=torch.int32)}, "w.dtype"),
        ({"w": torch.zeros(4, 48)}, "w.shape[1]"),
        ({"w": torch.zeros(4, 64), "group": 24}, "group"),
        ({"w": torch.full((4, 64), float("nan"))}, "w[0, 0]"),
        ({"w": torch.zeros(4, 64), "hessian": torch.ones(63)}, "hessian.shape"),
        ({"w": torch.zeros(4, 64), "hessian": -torch.ones(64)}, "hessian"),
        ({"w": torch.zeros(4, 64), "rate": 2.0}, "rate"),
        ({"w": torch.zeros(4, 64), "budget": Budget(n4=9, nnz=0)}, "budget.n4"),
        ({"w": torch.zeros(4, 64), "budget": Budget(n4=0, nnz=-1)}, "budget.nnz"),
    ],
)
def test_typed_errors(kwargs: dict[str, object], field: str) -> None:
    w = kwargs.pop("w")
    assert isinstance(w, torch.Tensor)
    with pytest.raises(MixedQuantError) as info:
        quantize_mixed(w, **kwargs)  # pyright: ignore[reportArgumentType]
    assert isinstance(info.value, QcError)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_all_zero_weight_decodes_to_zero() -> None:
    q = quantize_mixed(torch.zeros(8, 64), group=32, rate=4.0)
    assert bool(np.all(q.decode() == 0.0))


def test_a_listed_row_costs_one_map_entry_not_one_per_group() -> None:
    """``rate_bits`` with ``rows4``: a fully 4-bit 96 x 128 weight in groups of 32 pays 96 16-bit map
    entries (one a row), not 384 (one a group); the codes are the same either way."""
    n, k, g, groups = 96, 128, 32, 96 * 4

    def map_bits(n4: int, rows4: int) -> int:
        return rate_bits(n, k, g, 64, n4, 0, rows4) - rate_bits(n, k, g, 64, 0, 0) - 2 * g * n4

    assert map_bits(groups, 0) == 16 * groups
    assert map_bits(groups, n) == 16 * n
    assert map_bits(10 + 2 * 4, 2) == 16 * (10 + 2)  # two rows and ten other groups
    assert rate_bits(n, k, g, 64, groups, 0, n) == rate_bits(n, k, g, 64, groups, 0) - 16 * (groups - n)


def test_an_all_4_bit_budget_lists_every_row_and_no_group() -> None:
    w = heavy_weight()
    q = quantize_mixed(w, group=32, budget=Budget(n4=96 * 4, nnz=0))
    assert q.wide.size == 0
    assert (q.wide_rows.dtype, q.wide_rows.tolist()) == (np.int16, list(range(96)))
    assert q.n4 == 96 * 4
    assert bool(np.all(q.group_bits() == 4))
    assert q.rate_bits() == stored_bits(q) == rate_bits(96, 128, 32, 64, 96 * 4, 0, 96)


def test_whole_rows_of_a_mixed_weight_are_listed_as_rows() -> None:
    """The heavy rows' groups all 4-bit: listed in ``wide_rows``, never in ``wide`` (the canonical map)."""
    q = quantize_mixed(heavy_weight(), group=32, rate=3.2, outliers=0.01)
    whole = np.flatnonzero((q.group_bits() == 4).all(axis=1))
    assert whole.size > 0
    assert q.wide.size > 0
    assert q.wide_rows.tolist() == whole.tolist()
    assert map_problem(96, 4, q.wide, q.wide_rows) is None

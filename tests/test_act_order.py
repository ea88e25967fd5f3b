"""Act-order (GPTQ ``g_idx``) weights: freeze-semantics stores the columns grouped and makes the
permutation explicit; decode scatters back and equals the source's effective weight bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from qcompiler.errors import PassError
from qcompiler.ir import Module, parse_module, print_module, verify_module
from qcompiler.ir.attrs import AttrValue
from qcompiler.ir.blobs import read_array
from qcompiler.ir.builder import Builder
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.types import DenseType, QuantType
from qcompiler.passes.manager import PassManager
from qcompiler.passes.spec import parse_pipeline
from qcompiler.quant.reference import decode

N, K, G = 6, 40, 16


def gptq_weight(g_idx: np.ndarray, seed: int = 0) -> tuple[Module, np.ndarray]:
    """A module whose weight is GPTQ-style: codes in original column order, group of column k is g_idx[k]."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(-8, 8, size=(N, K)).astype(np.int8)
    groups = int(g_idx.max()) + 1
    scale = (rng.random((N, groups)) * 0.1 + 0.01).astype(np.float32)
    zero = rng.integers(-2, 3, size=(N, groups)).astype(np.int8)
    effective = ((codes.astype(np.float32) - zero[:, g_idx]) * scale[:, g_idx]).astype(np.float32)
    b = Builder(Module("gptq", attrs={"invariants": [], "provenance": {"source": "test"}}))
    b.graph("forward", x=DenseType(DTYPES["f32"], ("?batch", K)))
    attrs: dict[str, AttrValue] = {
        "source": "gptq",
        "codes": b.tensor("w.codes", codes, "i8"),
        "scale": b.tensor("w.scale", scale, "f32"),
        "zero": b.tensor("w.zero", zero, "i8"),
        "g_idx": b.tensor("w.g_idx", g_idx.astype(np.int32), "i32"),
        "block": [1, G],
        "qmin": -8,
        "qmax": 7,
        "effective": b.tensor("w.effective", effective, "f32"),
    }
    w = b.op("q.source_weight", [], DenseType(DTYPES["f32"], (N, K)), attrs, out="w")
    assert b.current is not None
    y = b.op("linear", [b.current.args[0], w], DenseType(DTYPES["f32"], ("?batch", N)), out="y")
    b.ret(y)
    verify_module(b.module)
    return b.module, effective


def shuffled_groups(seed: int = 0) -> np.ndarray:
    g = np.arange(K) // G
    return np.random.default_rng(seed).permutation(g)


def test_act_order_becomes_an_explicit_permutation() -> None:
    g_idx = shuffled_groups()
    m, effective = gptq_weight(g_idx)
    m = PassManager(parse_pipeline("freeze-semantics,canonicalize-axes,fuse-qdq")).run(m)
    w = next(op for op in m.ops() if op.name == "q.weight")
    t = w.result.type
    assert isinstance(t, QuantType)
    assert t.perm is not None
    assert t.perm.shape == (K,)
    perm = read_array(m, "w.perm")
    assert np.array_equal(np.sort(g_idx[perm]), g_idx[perm])  # stored grouped
    assert np.array_equal(np.argsort(perm)[perm], np.arange(K))  # the inverse undoes it
    parts = {k: read_array(m, v.name) for k, v in w.attrs.items()}  # type: ignore[union-attr]
    assert np.array_equal(np.asarray(decode(t, parts)).view(np.uint32), effective.view(np.uint32))
    verify_module(parse_module(print_module(m)))
    assert "perm=i32[40]" in print_module(m)


def test_g_idx_with_uneven_groups_is_refused() -> None:
    g_idx = shuffled_groups()
    g_idx[g_idx == 1] = 0  # group 0 now has 32 columns, group 1 none
    g_idx[0] = 2
    m, _ = gptq_weight(np.clip(g_idx, 0, 2))
    with pytest.raises(PassError, match="g_idx does not give every group 16 columns"):
        PassManager(parse_pipeline("freeze-semantics")).run(m)

"""Act-order (GPTQ ``g_idx``) weights: freeze-semantics stores the columns grouped and makes the
permutation explicit; decode scatters back and equals the source's effective weight bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from qcompiler.errors import PassError
from qcompiler.ir import Module, parse_module, print_module, verify_module
from qcompiler.ir.blobs import read_array
from qcompiler.ir.reference import decode
from qcompiler.ir.types import QuantType
from qcompiler.passes.manager import PassManager
from qcompiler.passes.spec import parse_pipeline
from qcompiler.testing import gptq_module, shuffled_act_order

N, K, G = 6, 40, 16


def gptq_weight(g_idx: np.ndarray, seed: int = 0, group: int = G) -> tuple[Module, np.ndarray]:
    return gptq_module(g_idx, N, group, seed)


def shuffled_groups(seed: int = 0, k: int = K, group: int = G) -> np.ndarray:
    return shuffled_act_order(k, group, seed)


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

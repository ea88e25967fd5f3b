"""Rung 4's accuracy contract, on constructed values: the token rule (equal, a near tie excused, a real
mismatch refused), the graph bound and the quantized-linear depth it scales with."""

from __future__ import annotations

import math

import pytest
import torch

from qcompiler.examples import TinyLlamaConfig, tiny_llama
from qcompiler.runtime.rungs import graph_bound, linear_depth, token_verdict

REF = torch.tensor([4.0, 3.99, 1.0, -2.0])  # argmax 0, a near tie with 1, far from 2 and 3
NORM = float(REF.norm())


def test_our_argmax_equal_to_the_references_is_equal() -> None:
    v = token_verdict(REF + 1e-3, REF, 0, 1e-2)
    assert v.kind == "equal"
    assert v.reference == 0
    assert v.margin == 0.0


def test_a_near_tie_within_the_bound_is_excused() -> None:
    bound = 1e-2
    ours = REF.clone()
    ours[1] += 0.02  # our logits move 0.02 (rel 3.5e-3 of ||REF|| = 5.75): enough to swap 0 and 1
    v = token_verdict(ours, REF, int(ours.argmax()), bound)
    assert v.kind == "near tie"
    assert v.reference == 0
    assert v.margin == pytest.approx(0.01)
    assert v.allowed == pytest.approx(math.sqrt(2) * bound * NORM)
    assert v.rel <= bound


def test_a_mismatch_beyond_the_margin_or_the_bound_is_refused() -> None:
    bound = 1e-2
    ours = REF.clone()
    ours[2] += 3.5  # token 2: the reference's margin is 3.0, far above sqrt(2) * 1e-2 * 5.75 = 0.081
    far = token_verdict(ours, REF, 2, bound)
    assert far.kind == "mismatch"
    assert far.margin == pytest.approx(3.0)
    ours = REF * 1.5
    ours[1] += 0.1  # token 1 is a near tie of the reference, but our row is 50% off
    off = token_verdict(ours, REF, 1, bound)
    assert off.margin <= off.allowed
    assert off.rel > bound
    assert off.kind == "mismatch"


def test_the_graph_bound_adds_the_kernel_bound_in_quadrature_along_the_depth() -> None:
    assert graph_bound(1e-5, 8) == pytest.approx(1e-5 * math.sqrt(8))
    assert graph_bound(8e-3, 88) == pytest.approx(8e-3 * math.sqrt(88))
    assert graph_bound(8e-3, 0) == 8e-3  # no quantized linear on the path: the kernel bound


@pytest.mark.parametrize(("layers", "depth"), [(1, 4), (2, 8)])
def test_the_linear_depth_counts_q_k_v_o_gate_up_down_as_four_per_layer(layers: int, depth: int) -> None:
    g = tiny_llama(TinyLlamaConfig(layers=layers)).graphs[0]
    assert sum(op.name == "q.linear" for op in g.ops) == 7 * layers
    assert linear_depth(g) == depth  # q (k, v beside it), o, gate (up beside it), down
    assert linear_depth(g, dense=True) == depth + 1  # and the dense lm_head, which bf16 compute may narrow

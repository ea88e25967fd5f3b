"""The ``Rewriter`` keeps uses current through replace, erase and insert; ``apply`` offers every op to
the patterns once, in program order; fuse-qdq's fold and materialize are patterns and undo each other."""

from __future__ import annotations

import pytest

from qcompiler.examples import tiny_llama
from qcompiler.ir import print_module
from qcompiler.ir.core import Graph, Op, Value, create_op
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.rewrite import Rewriter, apply
from qcompiler.ir.types import DenseType
from qcompiler.passes.fuse_qdq import fold, materialize

F32 = DenseType(DTYPES["f32"], (2, 2))


def chain() -> tuple[Graph, Value, Op, Op]:
    x = Value("x", F32)
    a = create_op("relu", [x], [F32], result_names=["a"])
    b = create_op("relu", [a.result], [F32], result_names=["b"])
    ret = create_op("return", [b.result], [])
    return Graph("main", [x], [a, b, ret]), x, a, b


def test_replace_moves_every_use_and_erase_refuses_a_used_op() -> None:
    g, x, a, b = chain()
    rw = Rewriter(g)
    assert rw.users(a.result) == [b]
    new = create_op("neg", [x], [F32], result_names=["a2"])
    rw.replace(a, new)
    assert g.ops[0] is new
    assert b.operands[0] is new.result
    assert rw.users(new.result) == [b]
    assert rw.users(a.result) == []
    assert rw.users(x) == [new]
    with pytest.raises(ValueError, match="cannot erase %a2 = neg: %b = relu still uses %a2"):
        rw.erase(new)


def test_insert_and_erase_keep_uses_in_program_order() -> None:
    g, x, a, b = chain()
    rw = Rewriter(g)
    early = create_op("neg", [x], [F32], result_names=["n"])
    rw.insert_before(a, early)
    assert g.ops[0] is early
    assert rw.users(x) == [early, a]
    rw.replace_uses(b.result, a.result)  # return now reads %a; %b is dead
    rw.erase(b)
    assert [op.name for op in g.ops] == ["neg", "relu", "return"]
    assert [op.name for op in rw.users(a.result)] == ["return"]


def test_apply_offers_each_op_once_and_counts_rewrites() -> None:
    g, _, _, _ = chain()
    seen: list[str] = []

    def negate_relus(rw: Rewriter, op: Op) -> bool:
        seen.append(op.results[0].name if op.results else op.name)
        if op.name != "relu":
            return False
        rw.replace(op, create_op("neg", list(op.operands), [F32], result_names=[op.result.name]))
        return True

    assert apply(g, [negate_relus]) == 2
    assert seen == ["a", "b", "return"]
    assert [op.name for op in g.ops] == ["neg", "neg", "return"]
    assert g.ops[1].operands[0] is g.ops[0].result


def test_fuse_qdq_patterns_fold_and_materialize_each_other() -> None:
    m = tiny_llama()
    before = print_module(m)
    g = m.graphs[0]
    ops = len(g.ops)
    unfolded = materialize(g)
    assert unfolded > 0
    assert len(g.ops) == ops + unfolded
    assert fold(g) == unfolded
    assert print_module(m) == before

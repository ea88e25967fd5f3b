"""The ``Rewriter`` keeps uses current through replace, erase and insert; ``apply`` offers every op to
the patterns once, in program order; fuse-qdq's fold and materialize are patterns and undo each other;
pack-layouts' ``dense`` conversion rewrites a weight's users through the same Rewriter."""

from __future__ import annotations

import numpy as np
import pytest

from qcompiler.errors import PassError
from qcompiler.examples import tiny_llama
from qcompiler.ir import print_module, verify_module
from qcompiler.ir.attrs import AttrValue
from qcompiler.ir.builder import Builder
from qcompiler.ir.core import Graph, Module, Op, Value, create_op
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.rewrite import Rewriter, apply
from qcompiler.ir.types import DenseType
from qcompiler.passes.conversions import DENSE_USES, to_dense
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


def test_an_op_reading_a_value_twice_leaves_no_stale_use() -> None:
    """``mul(%a, %a)`` is listed twice among %a's users (as ``Graph.users`` lists it); replacing it
    drops both entries."""
    x = Value("x", F32)
    a = create_op("relu", [x], [F32], result_names=["a"])
    sq = create_op("mul", [a.result, a.result], [F32], result_names=["s"])
    g = Graph("main", [x], [a, sq, create_op("return", [sq.result], [])])
    rw = Rewriter(g)
    assert rw.users(a.result) == [sq, sq]
    add = create_op("add", [a.result, a.result], [F32], result_names=["s"])
    rw.replace(sq, add)
    assert rw.users(a.result) == g.users()[id(a.result)] == [add, add]


def tail_weight_module() -> Module:
    """Two [4, 10] weights with groups of 4 along K (a partial tail): one read by ``q.linear``, one by
    ``q.dequantize -> linear``; both are what ``dense`` converts."""
    m = Module("tail")
    b = Builder(m)
    g = b.graph("g", x=DenseType(DTYPES["f32"], ("?batch", 10)))
    rng = np.random.default_rng(0)
    out = DenseType(DTYPES["f32"], ("?batch", 4))
    ws = [
        b.affine_weight(
            n, rng.integers(-8, 8, (4, 10)).astype(np.int8), np.full((4, 3), 0.5, np.float16), bits=4, group=4
        )
        for n in ("w1", "w2")
    ]
    y1 = b.op("q.linear", [g.args[0], ws[0]], out, out="y1")
    wd = b.op("q.dequantize", [ws[1]], DenseType(DTYPES["f32"], (4, 10)), out="w2_dq")
    y2 = b.op("linear", [g.args[0], wd], out, out="y2")
    b.ret(b.op("add", [y1, y2], out, out="z"))
    verify_module(m, data=True)
    return m


def convert_to_dense(m: Module, rw: Rewriter) -> list[dict[str, AttrValue]]:
    """``to_dense`` on every q.weight, then ``DENSE_USES`` over the graph, all through ``rw``."""
    records = []
    for op in [op for op in rw.g.ops if op.name == "q.weight"]:
        t = op.result.quant
        assert t is not None
        records.append(to_dense(m, rw, op, t, op.result.name))
    for op in list(rw.g.ops):
        if id(op) not in rw.removed:
            any(pattern(rw, op) for pattern in DENSE_USES)
    return records


def test_dense_conversion_rewrites_the_users_and_keeps_the_rewriters_users_current() -> None:
    m = tail_weight_module()
    g = m.graphs[0]
    rw = Rewriter(g)
    seen = [v for op in g.ops for v in op.results]
    records = convert_to_dense(m, rw)
    assert [r["kind"] for r in records] == ["dense", "dense"]
    assert all(r["max_abs_err"] == 0.0 for r in records)
    assert [op.name for op in g.ops] == ["const", "const", "linear", "linear", "add", "return"]
    assert [op.result.name for op in g.ops[:-1]] == ["w1", "w2", "y1", "y2", "z"]
    assert g.ops[3].operand("w") is g.ops[1].result  # the dequantize's users read the dense weight
    verify_module(m, data=True)
    fresh = g.users()
    for v in [*g.args, *seen, *g.values()]:
        assert rw.users(v) == fresh.get(id(v), []), v.name


def test_dense_conversion_refuses_a_user_with_no_dense_form() -> None:
    m = tail_weight_module()
    g = m.graphs[0]
    w1 = g.ops[0]
    g.ops[-1] = create_op("return", [w1.result], [])  # returns the quantized weight itself
    t = w1.result.quant
    assert t is not None
    with pytest.raises(PassError, match=r"^return: cannot use a weight converted to dense \(no dense form of return\)"):
        to_dense(m, Rewriter(g), w1, t, "w1")

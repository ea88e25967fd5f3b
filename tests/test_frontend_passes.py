"""Unit tests of canonicalize-axes and fuse-qdq on IR built by hand, and of the frontend's error for an
op it cannot lower."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from qcompiler.errors import PassError
from qcompiler.frontend import capture
from qcompiler.frontend.context import UnsupportedError
from qcompiler.ir import Graph, Module, Op, QuantType, Value, parse_module, print_module, verify_module
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import read_array
from qcompiler.ir.builder import Builder
from qcompiler.ir.dtypes import DTYPES, code_dtype
from qcompiler.ir.equality import modules_equal
from qcompiler.ir.reference import decode
from qcompiler.ir.rewrite import Rewriter
from qcompiler.ir.types import Alphabet, CodeContract, DenseType, GroupSpec, PackSpec
from qcompiler.passes.canonicalize_axes import canonicalize
from qcompiler.passes.manager import PassManager
from qcompiler.passes.spec import parse_pipeline
from qcompiler.quant.modules import quantize

F32 = DTYPES["f32"]


def claims(*invariants: str) -> dict[str, AttrValue]:
    """Module attributes claiming ``invariants`` (with the provenance semantics-frozen needs); fresh
    each call, since passes update module attributes."""
    return {"invariants": list[AttrValue](invariants), "provenance": {"source": "test"}}


def run(pipeline: str, m: Module) -> Module:
    return PassManager(parse_pipeline(pipeline)).run(m)


def weight(
    b: Builder,
    name: str,
    codes: np.ndarray,
    scale: np.ndarray,
    *,
    axis: int,
    size: int,
    zero: np.ndarray | None = None,
    req: str = "any",
) -> Value:
    """A 4-bit affine ``q.weight`` with f16 scales (and i8 zero points), groups of ``size`` along ``axis``."""
    code = code_dtype("i4")
    assert code is not None
    attrs: dict[str, AttrValue] = {"codes": b.tensor(f"{name}.codes", codes, "i8")}
    slots: list[tuple[str, DenseType | QuantType]] = [("scale", DenseType(DTYPES["f16"], tuple(scale.shape)))]
    attrs["scale"] = b.tensor(f"{name}.scale", scale, "f16")
    if zero is not None:
        slots.append(("zero", DenseType(DTYPES["i8"], tuple(zero.shape))))
        attrs["zero"] = b.tensor(f"{name}.zero", zero, "i8")
    t = QuantType(
        family="affine",
        code=CodeContract(code, Alphabet.range(-8, 7)),
        expressed=DenseType(F32, tuple(int(d) for d in codes.shape)),
        group=GroupSpec(axis=axis, size=size),
        qparams=tuple(slots),
        pack=PackSpec(),
        req=req,
    )
    return b.op("q.weight", [], t, attrs, out=name)


def rand_weight(shape: tuple[int, int], axis: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes in [-8, 7], f16 scales and i8 zero points for groups of ``size`` along ``axis``."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(-8, 8, size=shape).astype(np.int8)
    qshape = tuple(-(-d // size) if i == axis else d for i, d in enumerate(shape))
    scale = (rng.random(qshape) * 0.5 + 0.01).astype(np.float16)
    zero = rng.integers(-8, 8, size=qshape).astype(np.int8)
    return codes, scale, zero


def quant(v: Value) -> QuantType:
    assert isinstance(v.type, QuantType)
    return v.type


def op_named(g: Graph, result: str) -> Op:
    return next(op for op in g.ops if op.results and op.result.name == result)


def decoded(m: Module, w: Op) -> np.ndarray:
    parts: dict[str, np.ndarray] = {}
    for slot, ref in w.attrs.items():
        assert isinstance(ref, SymbolRef)
        parts[slot] = read_array(m, ref.name)
    return np.ascontiguousarray(decode(quant(w.result), parts), dtype=np.float32)


def kn_module(*, asym: bool, k: int = 70, n: int = 8, size: int = 32) -> Module:
    """``relu(matmul(x, dequantize(w)))`` with ``w`` stored [K, N], groups along K (axis 0)."""
    m = Module("kn", attrs=claims("semantics-frozen"))
    b = Builder(m)
    g = b.graph("forward", x=DenseType(F32, ("?batch", k)))
    codes, scale, zero = rand_weight((k, n), 0, size, seed=1)
    w = weight(b, "w", codes, scale, axis=0, size=size, zero=zero if asym else None)
    wd = b.op("q.dequantize", [w], DenseType(F32, (k, n)), out="wd")
    y = b.op("matmul", [g.args[0], wd], DenseType(F32, ("?batch", n)), out="y")
    z = b.op("relu", [y], DenseType(F32, ("?batch", n)), out="z")
    b.ret(z)
    verify_module(m, data=True)
    return m


# ------------------------------------------------------------------------------------ canonicalize-axes


@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
def test_kn_weight_used_by_matmul_becomes_nk_linear_with_the_same_decode(asym: bool) -> None:
    m = kn_module(asym=asym)
    g = m.graphs[0]
    before = decoded(m, op_named(g, "w"))
    old = {slot: read_array(m, ref.name) for slot, ref in op_named(g, "w").attrs.items() if isinstance(ref, SymbolRef)}

    out = run("canonicalize-axes", m)
    verify_module(out, data=True)
    assert out.invariants == ["semantics-frozen", "axes-canonical"]
    g = out.graphs[0]
    w = op_named(g, "w")
    t = quant(w.result)
    assert t.shape == (8, 70)
    assert t.group == GroupSpec(axis=1, size=32, tail="partial")
    assert dict(t.qparams)["scale"] == DenseType(DTYPES["f16"], (8, 3))
    assert ("zero" in dict(t.qparams)) == asym
    for slot, ref in w.attrs.items():  # codes and qparams are transposed, never changed
        assert isinstance(ref, SymbolRef)
        assert np.array_equal(read_array(out, ref.name), old[slot].T)
    after = decoded(out, w)
    assert np.array_equal(after.view(np.uint32), before.T.view(np.uint32))

    y = op_named(g, "y")
    assert y.name == "linear"
    assert y.operands[0] is g.args[0]
    assert y.operands[1] is op_named(g, "wd").result
    assert y.result.type == DenseType(F32, ("?batch", 8))
    assert op_named(g, "z").operands[0] is y.result  # users follow the new op
    assert not [op for op in g.ops if op.name == "matmul"]
    text = print_module(out)
    assert print_module(parse_module(text)) == text


def test_canonical_weight_then_fuse_qdq_gives_q_linear() -> None:
    m = kn_module(asym=True)
    before = decoded(m, op_named(m.graphs[0], "w"))
    out = run("canonicalize-axes,fuse-qdq", m)
    g = out.graphs[0]
    y = op_named(g, "y")
    assert y.name == "q.linear"
    assert y.operands[1] is op_named(g, "w").result
    assert not [op for op in g.ops if op.name == "q.dequantize"]
    assert np.array_equal(decoded(out, op_named(g, "w")).view(np.uint32), before.T.view(np.uint32))


def test_weight_grouped_along_n_used_by_linear_is_refused() -> None:
    """[N, K] = [8, 70] with groups along N (axis 0): canonical groups along K would need requantizing."""
    m = Module("nk", attrs=claims("semantics-frozen"))
    b = Builder(m)
    g = b.graph("forward", x=DenseType(F32, (2, 70)))
    codes, scale, _ = rand_weight((8, 70), 0, 4, seed=2)
    w = weight(b, "w", codes, scale, axis=0, size=4, req="linear")
    wd = b.op("q.dequantize", [w], DenseType(F32, (8, 70)), out="wd")
    b.ret(b.op("linear", [g.args[0], wd], DenseType(F32, (2, 8)), out="y"))
    verify_module(m)
    with pytest.raises(PassError) as e:
        run("canonicalize-axes", m)
    msg = str(e.value)
    assert "pass 'canonicalize-axes' failed" in msg
    assert "@w is a linear weight [N, K] grouped along N (axis 0)" in msg
    assert "requantization" in msg


def test_kn_weight_used_through_a_transpose_becomes_nk_linear() -> None:
    """canonicalize-axes' docstring: a [K, N] weight grouped along K that is dequantized and then used as
    matmul's right operand *or transposed* becomes [N, K]; here ``linear(x, transpose(dequantize(w)))``."""
    m = kn_transpose_module()
    before = decoded(m, op_named(m.graphs[0], "w"))
    out = run("canonicalize-axes", m)
    g = out.graphs[0]
    assert not [op for op in g.ops if op.name == "transpose"]
    assert quant(op_named(g, "w").result).group == GroupSpec(axis=1, size=32)
    assert np.array_equal(decoded(out, op_named(g, "w")).view(np.uint32), before.T.view(np.uint32))


def kn_transpose_module() -> Module:
    """``linear(x, transpose(dequantize(w)))`` with ``w`` stored [K, N] = [70, 8], groups along K."""
    m = Module("kn_t", attrs=claims("semantics-frozen"))
    b = Builder(m)
    g = b.graph("forward", x=DenseType(F32, (2, 70)))
    codes, scale, _ = rand_weight((70, 8), 0, 32, seed=3)
    w = weight(b, "w", codes, scale, axis=0, size=32)
    wd = b.op("q.dequantize", [w], DenseType(F32, (70, 8)), out="wd")
    wt = b.op("transpose", [wd], DenseType(F32, (8, 70)), {"perm": [1, 0]}, out="wt")
    b.ret(b.op("linear", [g.args[0], wt], DenseType(F32, (2, 8)), out="y"))
    verify_module(m)
    return m


@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
def test_kn_matmul_prints_as_the_nk_module_written_by_hand(asym: bool) -> None:
    """The pattern's output is, text for text, the [N, K] module: codes and qparams transposed, groups
    along axis 1, req=linear, a linear in the matmul's place and its user following it."""
    out = run("canonicalize-axes", kn_module(asym=asym))
    codes, scale, zero = rand_weight((70, 8), 0, 32, seed=1)  # kn_module's arrays
    m = Module("kn", attrs=claims("semantics-frozen", "axes-canonical"))
    b = Builder(m)
    g = b.graph("forward", x=DenseType(F32, ("?batch", 70)))
    nk_zero = np.ascontiguousarray(zero.T) if asym else None
    w = weight(b, "w", codes.T.copy(), scale.T.copy(), axis=1, size=32, zero=nk_zero, req="linear")
    wd = b.op("q.dequantize", [w], DenseType(F32, (8, 70)), out="wd")
    y = b.op("linear", [g.args[0], wd], DenseType(F32, ("?batch", 8)), out="y")
    b.ret(b.op("relu", [y], DenseType(F32, ("?batch", 8)), out="z"))
    assert print_module(out) == print_module(m)


@pytest.mark.parametrize("make", [lambda: kn_module(asym=True), kn_transpose_module], ids=["matmul", "transpose"])
def test_rewriter_users_stay_current_through_canonicalize(make: Callable[[], Module]) -> None:
    """The pattern edits only through the Rewriter: afterwards its users of every value, the ones it
    replaced or erased included, are those a fresh walk of the graph finds, in program order."""
    m = make()
    g = m.graphs[0]
    rw = Rewriter(g)
    seen = [v for op in g.ops for v in op.results]
    assert [canonicalize(m, rw, op) for op in list(g.ops)].count(True) == 1
    verify_module(m, data=True)
    fresh = g.users()
    for v in [*g.args, *seen, *g.values()]:
        assert rw.users(v) == fresh.get(id(v), []), v.name
    assert [op.name for op in rw.users(op_named(g, "wd").result)] == ["linear"]


# ------------------------------------------------------------------------------------ fuse-qdq


def qdq_module(form: str) -> Module:
    """A linear (with bias) and an embedding on two q.weights, in ``form``: ``fold`` (q.linear,
    q.embedding) or ``materialize`` (each dequantize right before its dense consumer, named as
    materialize names it)."""
    attrs = claims("semantics-frozen", "axes-canonical", "qdq-fused")
    attrs["qdq_form"] = form
    m = Module("qdq", attrs=attrs)
    b = Builder(m)
    g = b.graph("forward", x=DenseType(F32, ("?batch", 70)), ids=DenseType(DTYPES["i64"], ("?batch", "?seq")))
    codes, scale, zero = rand_weight((16, 70), 1, 32, seed=4)
    w = weight(b, "w", codes, scale, axis=1, size=32, zero=zero, req="linear")
    ecodes, escale, _ = rand_weight((50, 16), 1, 8, seed=5)
    e = weight(b, "e", ecodes, escale, axis=1, size=8, req="embedding")
    bias = b.const("fc.bias", np.linspace(-1, 1, 16, dtype=np.float32))
    if form == "fold":
        y = b.op("q.linear", [g.args[0], w, bias], DenseType(F32, ("?batch", 16)), out="y")
        h = b.op("q.embedding", [e, g.args[1]], DenseType(F32, ("?batch", "?seq", 16)), out="h")
    else:
        wd = b.op("q.dequantize", [w], DenseType(F32, (16, 70)), out="w_dq")
        y = b.op("linear", [g.args[0], wd, bias], DenseType(F32, ("?batch", 16)), out="y")
        ed = b.op("q.dequantize", [e], DenseType(F32, (50, 16)), out="e_dq")
        h = b.op("embedding", [ed, g.args[1]], DenseType(F32, ("?batch", "?seq", 16)), out="h")
    r = b.op("relu", [y], DenseType(F32, ("?batch", 16)), out="r")
    b.ret(r, h)
    verify_module(m, data=True)
    return m


def test_fold_then_materialize_gives_back_the_same_ir() -> None:
    original = qdq_module("materialize")
    folded = run("fuse-qdq", parse_module(print_module(original)))
    assert modules_equal(folded, qdq_module("fold"))
    g = folded.graphs[0]
    assert [op.name for op in g.ops if op.name.startswith("q.")] == ["q.weight", "q.weight", "q.linear", "q.embedding"]
    back = run("fuse-qdq{direction=materialize}", folded)
    assert modules_equal(back, original)
    assert print_module(back) == print_module(original)


def test_materialize_then_fold_gives_back_the_same_ir() -> None:
    original = qdq_module("fold")
    materialized = run("fuse-qdq{direction=materialize}", parse_module(print_module(original)))
    assert modules_equal(materialized, qdq_module("materialize"))
    back = run("fuse-qdq", materialized)
    assert modules_equal(back, original)


def test_round_trip_on_a_captured_model() -> None:
    """On a real pipeline output (MLP, w4-g32): materialize then fold is the identity."""
    torch.manual_seed(0)
    model = quantize(nn.Sequential(nn.Linear(70, 64), nn.ReLU(), nn.Linear(64, 16)), "w4-g32")
    m = capture(model, (torch.randn(2, 70),), dynamic={"input": {0: "batch"}}, name="seq")
    folded = run("freeze-semantics,canonicalize-axes,fuse-qdq", m)
    text = print_module(folded)
    materialized = run("fuse-qdq{direction=materialize}", parse_module(text))
    assert [op.name for op in materialized.ops() if op.name.startswith("q.")] == [
        "q.weight",
        "q.dequantize",
        "q.weight",
        "q.dequantize",
    ]
    back = run("fuse-qdq", materialized)
    assert modules_equal(back, parse_module(text))


def test_fold_a_dequantized_weight_shared_by_two_linears() -> None:
    """One q.weight used by two linears (a shared projection): both fold into q.linear on the weight.
    (Leaving the dequantize would break the qdq-fused invariant fuse-qdq itself establishes.)"""
    m = Module("shared", attrs=claims("semantics-frozen", "axes-canonical"))
    b = Builder(m)
    g = b.graph("forward", x=DenseType(F32, (2, 70)), v=DenseType(F32, (3, 70)))
    codes, scale, _ = rand_weight((8, 70), 1, 32, seed=6)
    w = weight(b, "w", codes, scale, axis=1, size=32)
    wd = b.op("q.dequantize", [w], DenseType(F32, (8, 70)), out="wd")
    a = b.op("linear", [g.args[0], wd], DenseType(F32, (2, 8)), out="a")
    c = b.op("linear", [g.args[1], wd], DenseType(F32, (3, 8)), out="c")
    b.ret(a, c)
    verify_module(m)
    out = run("fuse-qdq", m)
    g = out.graphs[0]
    assert [op.name for op in g.ops] == ["q.weight", "q.linear", "q.linear", "return"]
    assert all(op.operands[1] is op_named(g, "w").result for op in g.ops if op.name == "q.linear")


# ------------------------------------------------------------------------------------ frontend errors


class Scan(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumprod(x, dim=1)


class WithScan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.ReLU(), Scan()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for blk in self.blocks:
            h = blk(h)
        return h


def test_unsupported_op_names_the_op_the_module_path_and_the_source_line() -> None:
    lines, first = inspect.getsourcelines(Scan.forward)
    line = first + next(i for i, text in enumerate(lines) if "torch.cumprod" in text)
    with pytest.raises(UnsupportedError) as e:
        capture(WithScan(), (torch.randn(2, 8),), dynamic={"x": {0: "batch"}})
    msg = str(e.value)
    assert msg.startswith("unsupported op aten.cumprod.default")
    assert "module blocks.1," in msg
    assert f'File "{__file__}", line {line}, in forward' in msg

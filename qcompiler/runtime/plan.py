"""The execution plan: a loaded model's QIR graph lowered once per phase and input shape into a
``torch.fx.GraphModule`` (straight-line Python over torch calls), instead of walking the graph per step.

Lowering (``Lowering.op``, one entry of ``LOWER`` per op kind, the reference interpreter's rule otherwise):

- ``q.linear`` / ``q.embedding`` call their selected kernel's ``run`` on its prepared weight (the phase's
  decision); ``q.weight`` and ``const`` are no code at all (the kernel's handle, the resident tensor).
- Ops whose operands are all known at plan time (constants, the ``full`` scalars, shapes of this input)
  are folded: evaluated once with the reference rule, the value kept on the module (``FOLD_BYTES`` at most).
- A causal LM's positions continue from the KV cache (``kvcache.positions``) and each causal ``sdpa``
  attends through the preallocated cache (``kvcache.attend_cached``), reading the keys and values before
  the grouped-query repeat; the repeat's ops are then dead and dropped.
- Shapes are this plan's: reshapes, expands and slices carry constant sizes.

``Plan.gm.code`` is the generated Python (what runs per step); the first call of a plan runs through
``fx.Interpreter`` to measure the most bytes live at once (the runtime workspace), every later call runs
the generated code. Values are freed after their last use.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from qcompiler.ir.core import Op, narrow
from qcompiler.ir.interpret import BINARY, RULES, UNARY, Env, InterpretError, bind_dims, check_ids, torch_dtype
from qcompiler.ir.kv import causal_lm_dims, is_position, producers, repeat_source
from qcompiler.ir.ops.attention import Sdpa
from qcompiler.ir.ops.dense import Cast, Concat, Reshape, Slice, Transpose
from qcompiler.ir.ops.quant import QEmbedding, weight_name
from qcompiler.ir.ops.tensor import Expand, Reduce
from qcompiler.ir.types import DenseType
from qcompiler.runtime.kvcache import KVCache, attend_cached, positions
from qcompiler.runtime.load import LoadedModel, kernel

FOLD_BYTES = 16 * 2**20
"""A value computed at plan time from constants is kept folded up to this size (else computed per step)."""
Arg = Any
"""A lowered value: an ``fx.Node`` (computed per step) or a plan-time constant (tensor, op, handle)."""


def apply_rule(bundle: tuple[Callable[..., Any], Env, Op], *xs: Any) -> Any:
    """An op without a lowering: the reference interpreter's rule, on this plan's bound dims."""
    fn, env, op = bundle
    return fn(env, op, list(xs))


def dense_bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A dense linear whose weight is stored bf16, computed in bf16 (``compute="bf16"`` only)."""
    y = F.linear(x.to(torch.bfloat16), w, None if bias is None else bias.to(torch.bfloat16))
    return y.to(x.dtype)


def widened_rows(ids: torch.Tensor, table: torch.Tensor, dtype: torch.dtype, op: Op) -> torch.Tensor:
    """``embedding(cast(table), ids)`` as ``cast(embedding(table, ids))``: the same values, only the rows widened."""
    return F.embedding(check_ids(ids, table.shape[0], op), table).to(dtype)


def static(xs: list[Arg]) -> bool:
    """Whether every operand is known at plan time (the op can be folded)."""
    return all(not isinstance(x, fx.Node | Widened) for x in xs)


@dataclass(frozen=True)
class Widened:
    """``cast`` of a constant too large to fold (a bf16 embedding table or ``lm_head`` widened to f32):
    its consumers read the stored tensor (the rows an embedding gathers, a bf16 matmul), or widen it per step."""

    base: torch.Tensor
    dtype: torch.dtype


@dataclass
class Plan:
    gm: fx.GraphModule
    kernels: frozenset[str]
    workspace: int = -1
    """The most bytes live at once in one step (measured on the first call; -1 before)."""

    def __call__(self, inputs: list[torch.Tensor]) -> Any:
        if self.workspace < 0:
            meter = Meter(self.gm)
            out = meter.run(*inputs)
            self.workspace = meter.peak
            return out
        return self.gm(*inputs)


class Meter(fx.Interpreter):
    """Runs a plan node by node, keeping the most bytes live at once (values are dropped after last use)."""

    peak = 0

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        live = sum(v.numel() * v.element_size() for v in self.env.values() if isinstance(v, torch.Tensor))
        if isinstance(out, torch.Tensor):
            live += out.numel() * out.element_size()
        self.peak = max(self.peak, live)
        return out


@dataclass
class Lowering:
    lm: LoadedModel
    phase: str
    env: Env
    g: fx.Graph = field(default_factory=fx.Graph)
    root: torch.nn.Module = field(default_factory=torch.nn.Module)
    values: dict[int, Arg] = field(default_factory=dict[int, Arg])
    kernels: set[str] = field(default_factory=set[str])
    layer: int = 0
    count: int = 0

    def attr(self, value: Any) -> fx.Node:
        name = f"c_{self.count}"
        self.count += 1
        setattr(self.root, name, value)  # a plain attribute (get_attr copies it onto the GraphModule)
        return self.g.get_attr(name)

    def arg(self, x: Arg) -> Any:
        if isinstance(x, fx.Node) or x is None or isinstance(x, int | float | bool | str):
            return x
        if isinstance(x, Widened):  # a consumer that needs the whole widened tensor: widened per step
            return self.method("to", x.base, x.dtype)
        return self.attr(x)

    def call(self, fn: Callable[..., Any], *args: Arg, **kwargs: Any) -> fx.Node:
        return self.g.call_function(fn, tuple(self.arg(a) for a in args), kwargs)

    def method(self, name: str, x: Arg, *args: Any, **kwargs: Any) -> fx.Node:
        return self.g.call_method(name, (self.arg(x), *args), kwargs)

    def rule(self, op: Op, xs: list[Arg]) -> Arg:
        fn = RULES.get(op.name)
        if fn is None:
            raise InterpretError(f"{op.describe()}: no rule for '{op.name}'")
        if static(xs) and op.name not in DYNAMIC:
            with torch.no_grad():
                folded = fn(self.env, op, xs)
            if not isinstance(folded, torch.Tensor) or folded.numel() * folded.element_size() <= FOLD_BYTES:
                return folded.to(self.lm.place.torch_device) if isinstance(folded, torch.Tensor) else folded
        return self.call(apply_rule, (fn, self.env, op), *xs)

    def quantized(self, op: Op, xs: list[Arg]) -> Arg:
        if op.name == "q.weight":
            return op
        w: Op = xs[1] if op.name == "q.linear" else xs[0]
        name = weight_name(w)
        d = self.lm.decision(name, self.phase)
        k = kernel(d.selected)
        assert k.run is not None
        self.kernels.add(k.id)
        handle = self.lm.handles[(name, d.selected)]
        if op.name == "q.linear":
            return self.call(k.run, handle, xs[0], xs[2] if len(xs) > 2 else None)
        if isinstance(op, QEmbedding):
            ids = self.call(check_ids, xs[1], int(op.w.type.shape[0]), op)
            return self.call(k.run, handle, ids, None)
        return handle["weight"]  # q.dequantize: the fallback's dense buffer


DYNAMIC = frozenset({"q.quantize"})
"""Ops never folded even on constant operands (they read state at run time)."""
Lower = Callable[[Lowering, Op, list[Arg]], Arg]


def shape_of(lo: Lowering, shape: list[Any]) -> list[int]:
    return [lo.env.size(d) for d in shape]


def lower_reshape(lo: Lowering, op: Op, xs: list[Arg]) -> Arg:
    shape = narrow(op, Reshape).shape if op.name == "reshape" else narrow(op, Expand).shape
    return lo.method(op.name, xs[0], shape_of(lo, list(shape)))


def lower_transpose(lo: Lowering, op: Op, xs: list[Arg]) -> Arg:
    return lo.method("permute", xs[0], *narrow(op, Transpose).perm)


def lower_slice(lo: Lowering, op: Op, xs: list[Arg]) -> Arg:
    t, sl = op.operands[0].type, narrow(op, Slice)
    assert isinstance(t, DenseType)
    index: list[slice] = [slice(None)] * t.rank
    index[sl.axis % t.rank] = slice(sl.start, lo.env.size(sl.end), sl.step)  # torch clamps the end, as the rule does
    return lo.call(operator.getitem, xs[0], tuple(index))


def lower_cast(lo: Lowering, op: Op, xs: list[Arg]) -> Arg:
    dtype = torch_dtype(narrow(op, Cast).dtype.name, op)
    x = xs[0]
    if isinstance(x, torch.Tensor) and x.numel() * dtype.itemsize > FOLD_BYTES:
        return Widened(x, dtype)
    if not isinstance(x, fx.Node):
        return lo.rule(op, xs)
    return lo.method("to", x, dtype)


def lower_embedding(lo: Lowering, op: Op, xs: list[Arg]) -> Arg:
    table = xs[0]
    if isinstance(table, Widened):
        return lo.call(widened_rows, xs[1], table.base, table.dtype, op)
    return lo.rule(op, xs)


def lower_linear(lo: Lowering, op: Op, xs: list[Arg]) -> Arg:
    x, w, bias = xs[0], xs[1], xs[2] if len(xs) > 2 else None
    xt = op.operands[0].type
    if isinstance(w, Widened):
        if w.base.dtype == torch.bfloat16 and lo.lm.compute == "bf16":
            return lo.call(dense_bf16, x, w.base, bias)
        return lo.call(F.linear, x, w, bias)  # widened per step, as the reference does
    if not isinstance(w, torch.Tensor) or not isinstance(xt, DenseType):
        return lo.rule(op, xs)
    if w.dtype == torch_dtype(xt.dtype.name, op):
        return lo.call(F.linear, x, w, bias)
    if w.dtype == torch.bfloat16 and lo.lm.compute == "bf16":
        return lo.call(dense_bf16, x, w, bias)
    return lo.rule(op, xs)  # the weight widened per step, as the reference does


def lower_concat(lo: Lowering, op: Op, xs: list[Arg]) -> Arg:
    if static(xs):
        return lo.rule(op, xs)
    return lo.g.call_function(torch.cat, ([lo.arg(x) for x in xs],), {"dim": narrow(op, Concat).axis})


def lower_reduce(lo: Lowering, op: Op, xs: list[Arg]) -> Arg:
    r = narrow(op, Reduce)
    return lo.method(op.name, xs[0], list(r.axes), keepdim=r.keepdim)


def elementwise(fn: Callable[..., Any]) -> Lower:
    def lower(lo: Lowering, op: Op, xs: list[Arg]) -> Arg:
        if static(xs):
            return lo.rule(op, xs)
        return lo.call(fn, *xs)

    return lower


LOWER: dict[str, Lower] = {
    "reshape": lower_reshape,
    "expand": lower_reshape,
    "transpose": lower_transpose,
    "slice": lower_slice,
    "cast": lower_cast,
    "linear": lower_linear,
    "embedding": lower_embedding,
    "concat": lower_concat,
    "mean": lower_reduce,
    "sum": lower_reduce,
    **{name: elementwise(fn) for name, fn in (BINARY | UNARY).items()},
}
"""Op kind -> its lowering (``RULES`` through ``apply_rule`` for the rest)."""


def build(lm: LoadedModel, cache: KVCache, inputs: list[torch.Tensor], phase: str, named: bool) -> Plan:
    """The plan of ``lm``'s graph for inputs shaped like ``inputs`` in ``phase`` (see the module docstring)."""
    g = lm.graph
    env = Env(lm.module)
    bind_dims(env, g.args, inputs)
    lo = Lowering(lm, phase, env)
    dims = causal_lm_dims(g)
    made_by = producers(g)
    for a in g.args:
        lo.values[id(a)] = lo.g.placeholder(a.name)
    outputs: list[Arg] = []
    for op in g.ops:
        xs = [lo.values[id(v)] for v in op.operands]
        if op.name == "return":
            outputs = [lo.arg(x) for x in xs]
            break
        if dims is not None and is_position(op, dims[1]):
            t = op.result.type
            assert isinstance(t, DenseType)
            out = lo.call(positions, cache, env.size(dims[1]), torch_dtype(t.dtype.name, op), lm.place.torch_device)
        elif dims is not None and isinstance(op, Sdpa) and op.causal and len(xs) == 3:
            (k_src, _), (v_src, _) = repeat_source(made_by, op.k), repeat_source(made_by, op.v)
            k, v = lo.values[id(k_src)], lo.values[id(v_src)]
            out = lo.call(attend_cached, cache, lo.layer, xs[0], k, v, op)
            lo.layer += 1
        elif op.name.startswith("q."):
            out = lo.quantized(op, xs)
        elif op.name == "const":
            out = lm.constant(env, op)
        else:
            out = LOWER.get(op.name, Lowering.rule)(lo, op, xs)
        lo.values[id(op.result)] = out
    if named:  # every value computed per step, by result name
        nodes = ((op.result.name, lo.values.get(id(op.result))) for op in g.ops if op.results)
        lo.g.output((outputs, {n: v for n, v in nodes if isinstance(v, fx.Node)}))
    else:
        lo.g.output(outputs)
    lo.g.eliminate_dead_code()
    return Plan(fx.GraphModule(lo.root, lo.g), frozenset(lo.kernels))

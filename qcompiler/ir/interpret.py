"""A reference interpreter: run a QIR graph with torch, one table entry per op.

It defines what a graph *means* so the frontend can be checked against the model it came from.
Quantized values are carried decoded (the reference decoder's output), so ``q.linear`` is
``x @ decode(w).T``: this is the oracle, not a fast kernel. Dynamic dims (``?seq``) are bound from
the shapes of the graph's inputs.

    outputs = run_graph(module, [input_ids])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from qcompiler.errors import QcError
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import read_array
from qcompiler.ir.core import Module, Op, narrow
from qcompiler.ir.lazy import Decoded, LazyRows
from qcompiler.ir.ops.attention import Rotary, Sdpa, keep_mask
from qcompiler.ir.ops.dense import Cast, Concat, Const, Gelu, Norm, Reshape, Slice, Softmax, Transpose
from qcompiler.ir.ops.quant import Quantize, SourceWeight
from qcompiler.ir.ops.tensor import Arange, Expand, Full, Gather, Reduce, TopkMask
from qcompiler.ir.types import DenseType, QuantType

TORCH: dict[str, torch.dtype] = {
    "f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
    "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8, "u8": torch.uint8, "bool": torch.bool,
}  # fmt: skip


def as_torch(arr: np.ndarray, dtype: str) -> torch.Tensor:
    """A stored array as a (writable, owned) torch tensor of IR dtype ``dtype`` (bf16 arrives as raw uint16 bits)."""
    if dtype == "bf16":
        return torch.from_numpy(arr.astype(np.int16)).view(torch.bfloat16)  # astype copies: owned, writable
    return torch.from_numpy(np.array(arr))


class InterpretError(QcError):
    """The interpreter met an op it has no rule for, or inputs that do not fit the graph."""


def torch_dtype(name: str, op: Op) -> torch.dtype:
    """The torch dtype an op computes in; an IR dtype the interpreter cannot compute in (``f8e4m3``,
    ``u32``, ...) is an ``InterpretError`` naming the op."""
    dtype = TORCH.get(name)
    if dtype is None:
        raise InterpretError(f"{op.describe()}: the interpreter does not compute in {name} (known: {', '.join(TORCH)})")
    return dtype


class InputError(InterpretError):
    """An input value the graph cannot take: a token id outside the vocabulary, a wrong dtype."""


def check_ids(ids: torch.Tensor, rows: int, op: Op) -> torch.Tensor:
    """``ids`` if every one indexes a row of a ``rows``-row table, else an ``InputError`` naming the op
    and the first id out of range (torch would raise an IndexError, or read out of bounds on a GPU)."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise InputError(f"{op.describe()}: token ids must be integers (found {ids.dtype})")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise InputError(f"{op.describe()}: token id {bad} is outside the vocabulary (expected 0..{rows - 1})")
    return ids


class Env:
    """Module, bound dynamic dims, and a cache of decoded tensors."""

    def __init__(self, m: Module) -> None:
        self.m = m
        self.dims: dict[str, int] = {}

    def size(self, d: AttrValue) -> int:
        if isinstance(d, str):
            if d not in self.dims:
                raise InterpretError(f"dynamic dim {d} is not bound by any input")
            return self.dims[d]
        assert isinstance(d, int)
        return d

    def tensor(self, ref: AttrValue) -> torch.Tensor:
        assert isinstance(ref, SymbolRef)
        return as_torch(read_array(self.m, ref.name), self.m.tensors[ref.name].blob.dtype.name)


Rule = Callable[[Env, Op, list[Any]], Any]
RULES: dict[str, Rule] = {}


def rule(*names: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for n in names:
            RULES[n] = fn
        return fn

    return register


def attr(op: Op, name: str, default: Any = None) -> Any:
    return op.attrs.get(name, default)


def parts_of(env: Env, binding: dict[str, AttrValue]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in binding.items():
        out[k] = parts_of(env, v) if isinstance(v, dict) else read_array(env.m, v.name)  # type: ignore[union-attr]
    return out


@rule("q.weight")
def _weight(env: Env, op: Op, xs: list[Any]) -> torch.Tensor | Decoded:
    from qcompiler.ir import row_blocks
    from qcompiler.ir.layouts import logical_view
    from qcompiler.ir.reference import decode

    t = op.result.type
    assert isinstance(t, QuantType)
    parts = parts_of(env, op.attrs)
    if row_blocks.huge(t):  # decoded a block of rows at a time, by the ops that read it
        n, k = (int(d) for d in t.shape)

        def rows(r0: int, r1: int) -> np.ndarray:
            return row_blocks.decoded_rows(parts, t, r0, r1)

        return Decoded((n, k), rows, max(1, row_blocks.BLOCK_ELEMENTS // max(k, 1)))
    parts["codes"], logical = logical_view(parts["codes"], t, parts)
    return torch.from_numpy(np.asarray(decode(logical, parts), dtype=np.float32))


@rule("q.source_weight")
def _source(env: Env, op: Op, xs: list[Any]) -> torch.Tensor:
    effective = narrow(op, SourceWeight).effective
    if effective is None:
        raise InterpretError(f"{op.describe()}: a streamed source weight (decode_op) has no effective tensor to run")
    return env.tensor(effective)


@rule("q.quantize")
def _quantize(env: Env, op: Op, xs: list[Any]) -> torch.Tensor:
    t = op.result.type
    assert isinstance(t, QuantType)
    bind = narrow(op, Quantize).bind
    if bind is None:
        raise InterpretError(f"{op.describe()}: dynamic activation qparams are not interpreted")
    dev = xs[0].device  # the runtime may run this graph on a CUDA device
    scale, zero = env.tensor(bind["scale"]).double().to(dev), env.tensor(bind["zero"]).double().to(dev)
    codes = torch.clamp(torch.round(xs[0].double() / scale) + zero, t.code.alphabet.lo, t.code.alphabet.hi)
    return ((codes - zero) * scale).to(xs[0].dtype)


LAZY_BYTES = 64 * 2**20
"""A 2-D constant this large stays its stored bytes (``Lazy``) until an op needs more than rows of it."""


@dataclass(frozen=True)
class Lazy(LazyRows):
    """A large 2-D constant not made a tensor yet: the verified stored array (``qcompiler.ir.lazy``)."""

    arr: np.ndarray
    dtype: str
    casts: tuple[torch.dtype, ...] = ()

    @property
    def rows_count(self) -> int:
        return int(self.arr.shape[0])

    def fetch(self, index: Any) -> torch.Tensor:
        return as_torch(self.arr[index], self.dtype)


def eager(x: Any) -> Any:
    return x.whole() if isinstance(x, LazyRows) else x


def _const(env: Env, op: Op, xs: list[Any]) -> Any:
    ref = narrow(op, Const).ref
    arr, dtype = read_array(env.m, ref.name), env.m.tensors[ref.name].blob.dtype.name
    return Lazy(arr, dtype) if arr.ndim == 2 and arr.nbytes >= LAZY_BYTES else as_torch(arr, dtype)


def _cast(env: Env, op: Op, xs: list[Any]) -> Any:
    dtype = torch_dtype(narrow(op, Cast).dtype.name, op)
    x = xs[0]
    return x.cast(dtype) if isinstance(x, LazyRows) else x.to(dtype)


LINEAR_BLOCK_BYTES = 2 << 20
"""float32 weight rows a lazy ``linear`` makes and multiplies at a time: the block is still in the
core's cache when it is multiplied. The 1.1B graph probe on one thread: 1.9-2.1 s and a 652 MB peak,
against 3.0 s and 673 MB for 4096-row blocks (32 MB each, written out to memory and read back).
Blocks this small come from glibc's heap (``qcompiler/heap.py``), so each block's output is copied
into one output made first: kept as a list of pieces to concatenate, each piece sat where the next
block's temporaries would have fitted and the heap grew by about a block per block (the 8B graph
probe's 128256-row head: 2.3 GB)."""


def _linear(env: Env, op: Op, xs: list[Any]) -> torch.Tensor:
    x, w, rest = eager(xs[0]), xs[1], [eager(b) for b in xs[2:]]
    if not isinstance(w, LazyRows):
        return F.linear(x, w.to(x.dtype), *rest)
    bias = rest[0] if rest else None
    out = x.new_empty((*x.shape[:-1], w.rows_count))  # filled in place: see LINEAR_BLOCK_BYTES
    step = max(1, min(w.BLOCK, LINEAR_BLOCK_BYTES // (4 * max(int(x.shape[-1]), 1))))
    for i in range(0, w.rows_count, step):
        sl = slice(i, i + step)
        out[..., sl] = F.linear(x, w.rows(sl).to(x.dtype), None if bias is None else bias[sl])
    return out


def _embedding(env: Env, op: Op, xs: list[Any]) -> torch.Tensor:
    table, ids = xs[0], eager(xs[1])
    if not isinstance(table, LazyRows):
        return F.embedding(check_ids(ids, table.shape[0], op), table)
    ids = check_ids(ids, table.rows_count, op)
    rows = table.rows(ids.reshape(-1).cpu().numpy())
    return rows.reshape(*ids.shape, rows.shape[-1]).to(ids.device)


LAZY_OPS = frozenset({"cast", "linear", "q.linear", "embedding", "q.embedding", "q.dequantize"})
"""Ops whose rule takes a ``Lazy`` operand; every other rule gets its operands as tensors."""

RULES["q.dequantize"] = lambda env, op, xs: xs[0]
RULES["const"] = _const
RULES["full"] = lambda env, op, xs: torch.full(
    [env.size(d) for d in narrow(op, Full).shape],
    narrow(op, Full).value,
    dtype=torch_dtype(dense_of(op).dtype.name, op),
)
RULES["arange"] = lambda env, op, xs: torch.arange(
    narrow(op, Arange).start,
    env.size(narrow(op, Arange).end),
    narrow(op, Arange).step,
    dtype=torch_dtype(dense_of(op).dtype.name, op),
)
RULES["linear"] = RULES["q.linear"] = _linear
RULES["matmul"] = lambda env, op, xs: torch.matmul(xs[0], xs[1])
RULES["embedding"] = RULES["q.embedding"] = _embedding
RULES["cast"] = _cast
RULES["transpose"] = lambda env, op, xs: xs[0].permute(*narrow(op, Transpose).perm)
RULES["reshape"] = lambda env, op, xs: xs[0].reshape([env.size(d) for d in narrow(op, Reshape).shape])
RULES["expand"] = lambda env, op, xs: xs[0].expand([env.size(d) for d in narrow(op, Expand).shape])
RULES["concat"] = lambda env, op, xs: torch.cat(xs, dim=narrow(op, Concat).axis)
RULES["gather"] = lambda env, op, xs: torch.gather(xs[0], narrow(op, Gather).axis, xs[1])
RULES["softmax"] = lambda env, op, xs: torch.softmax(xs[0], dim=narrow(op, Softmax).axis)
RULES["gelu"] = lambda env, op, xs: F.gelu(xs[0], approximate=narrow(op, Gelu).approximate)
RULES["mean"] = lambda env, op, xs: xs[0].mean(dim=narrow(op, Reduce).axes, keepdim=narrow(op, Reduce).keepdim)
RULES["sum"] = lambda env, op, xs: xs[0].sum(dim=narrow(op, Reduce).axes, keepdim=narrow(op, Reduce).keepdim)
# as written: an int bound clamps an int tensor without promoting it to float (Clamp.min reads as float)
RULES["clamp"] = lambda env, op, xs: torch.clamp(xs[0], attr(op, "min"), attr(op, "max"))
RULES["layer_norm"] = lambda env, op, xs: F.layer_norm(xs[0], [xs[0].shape[-1]], *xs[1:], eps=narrow(op, Norm).eps)

BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
          "maximum": torch.maximum, "minimum": torch.minimum}  # fmt: skip
UNARY = {"neg": torch.neg, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
         "abs": torch.abs, "relu": torch.relu, "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
         "erf": torch.erf, "cos": torch.cos, "sin": torch.sin}  # fmt: skip
for _n, _f in BINARY.items():
    RULES[_n] = lambda env, op, xs, f=_f: f(xs[0], xs[1])
for _n, _f in UNARY.items():
    RULES[_n] = lambda env, op, xs, f=_f: f(xs[0])


def dense_of(op: Op) -> DenseType:
    t = op.result.type
    assert isinstance(t, DenseType)
    return t


@rule("slice")
def _slice(env: Env, op: Op, xs: list[Any]) -> torch.Tensor:
    x = xs[0]
    sl = narrow(op, Slice)
    axis = sl.axis % x.dim()
    end = env.size(sl.end)
    index = [slice(None)] * x.dim()
    index[axis] = slice(sl.start, min(end, x.shape[axis]), sl.step)
    return x[tuple(index)]


@rule("topk_mask")
def _topk_mask(env: Env, op: Op, xs: list[Any]) -> torch.Tensor:
    values, index = torch.topk(xs[0], narrow(op, TopkMask).k, dim=-1)
    return torch.zeros_like(xs[0]).scatter(-1, index, values)


@rule("rms_norm")
def _rms(env: Env, op: Op, xs: list[Any]) -> torch.Tensor:
    x = xs[0]
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + narrow(op, Norm).eps)
    return y * xs[1] if len(xs) > 1 else y


@rule("rotary")
def _rotary(env: Env, op: Op, xs: list[Any]) -> torch.Tensor:
    x, cos, sin = xs
    if narrow(op, Rotary).style == "half":
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    else:
        pairs = x.unflatten(-1, (-1, 2))
        rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    return x * cos + rotated * sin


@rule("sdpa")
def _sdpa(env: Env, op: Op, xs: list[Any]) -> torch.Tensor:
    q, k, v = xs[:3]
    return attend(narrow(op, Sdpa), q, k, v, xs[3] if len(xs) > 3 else None)


def attend(op: Sdpa, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``sdpa``'s meaning (its docstring): a causal mask (sliding window included) joins ``mask``;
    a soft cap is applied to the scores before either."""
    causal = op.causal
    if causal and (mask is not None or op.window is not None or op.softcap is not None):
        tri = keep_mask(q.shape[-2], k.shape[-2], op.window, q.device)
        mask = tri if mask is None else (mask if mask.dtype == torch.bool else mask == 0) & tri
        causal = False
    if op.softcap is None:
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=op.scale, enable_gqa=gqa)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) * (op.scale if op.scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / op.softcap) * op.softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, dim=-1) @ v


def bind_dims(env: Env, args: list[Any], values: list[torch.Tensor]) -> None:
    for a, x in zip(args, values, strict=True):
        t = a.type
        if not isinstance(t, DenseType) or t.rank != x.dim():
            raise InterpretError(f"input %{a.name} expects {t}, got shape {list(x.shape)}")
        for d, n in zip(t.shape, x.shape, strict=True):
            if isinstance(d, str):
                if env.dims.setdefault(d, int(n)) != n and d != "?":
                    raise InterpretError(f"dynamic dim {d} is {env.dims[d]} in one input and {n} in another")
            elif d != n:
                raise InterpretError(f"input %{a.name}: dim is {n}, the graph says {d}")


def run_graph(
    m: Module, inputs: list[torch.Tensor], graph: str = "", named: dict[str, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Run graph ``graph`` (default: the first) of ``m`` on ``inputs``; returns the outputs. ``named``, when
    given, receives every intermediate value by result name (not the large weights kept unexpanded)."""
    g = m.graph(graph) if graph else m.graphs[0]
    if g is None:
        raise InterpretError(f"no graph @{graph}")
    env = Env(m)
    bind_dims(env, g.args, inputs)
    values: dict[int, Any] = {id(a): x for a, x in zip(g.args, inputs, strict=True)}
    last_use = {id(v): i for i, op in enumerate(g.ops) for v in op.operands}
    with torch.no_grad():
        for i, op in enumerate(g.ops):
            xs = [values[id(v)] for v in op.operands]
            if op.name not in LAZY_OPS:
                xs = [eager(x) for x in xs]
            if op.name == "return":
                return xs
            fn = RULES.get(op.name)
            if fn is None:
                raise InterpretError(f"{op.describe()}: no interpreter rule for '{op.name}'")
            values[id(op.result)] = fn(env, op, xs)
            if named is not None and not isinstance(values[id(op.result)], LazyRows):  # weights stay unexpanded
                named[op.result.name] = values[id(op.result)]
            for v in op.operands:  # a value is dropped after its last use: memory follows the live set
                if last_use.get(id(v)) == i:
                    values.pop(id(v), None)
            del xs
    raise InterpretError("graph has no return")


__all__ = ["RULES", "InterpretError", "run_graph"]

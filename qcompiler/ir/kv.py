"""What a causal LM graph's attention reads, for runtimes that keep a KV cache.

A captured Llama repeats each key/value head over its query heads before ``sdpa``
(``reshape -> expand -> reshape``, grouped-query attention). A cache must hold the tensors before
that repeat (``[batch, kv_heads, seq, head_dim]``), so ``repeat_source`` walks back to them. The
rotary position is ``arange(0, ?seq)`` over the input's sequence dim (``is_position``); with a cache
it continues from the cache length.
"""

from __future__ import annotations

from qcompiler.ir.core import Graph, Op, Value
from qcompiler.ir.ops.attention import Sdpa
from qcompiler.ir.ops.dense import Reshape
from qcompiler.ir.ops.tensor import Arange, Expand
from qcompiler.ir.types import DenseType


def producers(g: Graph) -> dict[int, Op]:
    return {id(r): op for op in g.ops for r in op.results}


def repeat_source(made_by: dict[int, Op], v: Value) -> tuple[Value, int]:
    """The ``[batch, kv_heads, seq, head_dim]`` value behind a grouped-query repeat, and the repeat."""
    outer = made_by.get(id(v))
    mid = made_by.get(id(outer.x)) if isinstance(outer, Reshape) and outer.operands else None
    inner = made_by.get(id(mid.x)) if isinstance(mid, Expand) and mid.operands else None
    if not isinstance(inner, Reshape):
        return v, 1
    src = inner.x
    heads, kv_heads = (t.shape[1] if isinstance(t, DenseType) else 0 for t in (v.type, src.type))
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
        return v, 1
    return src, heads // kv_heads


def is_position(op: Op, seq_dim: str) -> bool:
    """``arange(0, ?seq)`` over the input's sequence dim: the positions a cache shifts."""
    return isinstance(op, Arange) and op.start == 0 and op.end == seq_dim


def causal_lm_dims(g: Graph) -> tuple[str, str] | None:
    """``(batch, seq)`` dims of a causal LM graph (one ``[?batch, ?seq]`` input, causal sdpa), else None."""
    if len(g.args) != 1 or not any(isinstance(op, Sdpa) and op.causal for op in g.ops):
        return None
    t = g.args[0].type
    if not isinstance(t, DenseType) or t.rank != 2 or not all(isinstance(d, str) for d in t.shape):
        return None
    batch, seq = t.shape
    assert isinstance(batch, str)
    assert isinstance(seq, str)
    return batch, seq


def per_row_positions(g: Graph, seq_dim: str, batch_dim: str) -> set[int]:
    """Values computed from the positions that are shared by every row (leading dim 1, or the
    ``[?seq]`` range itself). With per-row positions (``position_ids [batch, seq]``, which left
    padding needs) each gains the batch as its leading axis; ``id``s of those values. A value whose
    leading dim is already ``batch_dim`` (the hidden state after the rotary product) is not one.

    ``%arange = arange() {start = 0, end = "?seq", step = 1} : tensor<i64[?seq]>`` and
    ``%r = reshape(%arange) {shape = [1, "?seq"]} : tensor<i64[1,?seq]>`` are such values."""
    out: set[int] = set()
    for op in g.ops:
        if is_position(op, seq_dim):
            out.add(id(op.result))
            continue
        if not any(id(v) in out for v in op.operands):
            continue
        for r in op.results:
            if isinstance(r.type, DenseType) and r.type.rank >= 1 and r.type.shape[0] != batch_dim:
                out.add(id(r))
    return out

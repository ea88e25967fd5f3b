"""A causal LM's ``model.onnx``: the KV-cache decoder graph onnxruntime-genai and optimum run.

| | name | type | shape |
|---|---|---|---|
| input | ``input_ids`` | int64 | ``[batch_size, sequence_length]`` |
| input | ``attention_mask`` | int64 | ``[batch_size, total_sequence_length]`` (1: attend; past and current) |
| input | ``position_ids`` | int64 | ``[batch_size, sequence_length]`` |
| input | ``past_key_values.i.key``, ``.value`` | activations | ``[batch_size, kv_heads, past, head_dim]`` |
| output | ``logits`` | activations | ``[batch_size, sequence_length, vocab]`` |
| output | ``present.i.key``, ``.value`` | activations | ``[batch_size, kv_heads, total, head_dim]`` |

``i`` counts the attention layers in order; ``past`` is ``past_sequence_length``, which may be 0 (the
prefill), and ``total`` is ``total_sequence_length``. The
captured graph computes a whole sequence from positions ``0..seq``; lowered with the cache:

- the position ``arange(0, ?seq)`` is ``position_ids``, one row per sequence (left padding gives each
  row its own); the values computed from it that were shared by the rows (``[1, seq, ...]``, the
  rotary tables) gain the batch as their leading axis (``ir.kv.per_row_positions``);
- each causal ``sdpa``'s keys and values are traced back through their grouped-query repeat
  (``reshape -> expand -> reshape``) to the rotated ``[batch, kv_heads, seq, head_dim]`` tensors, which
  are appended to the cache (``Concat`` on axis 2) and repeated again over the query heads;
- one mask per window size, shared by the layers: query row ``r`` (cache slot ``past + r``) sees
  key ``j`` when ``j <= past + r`` and ``attention_mask[b, j] == 1``, and for a sliding window when
  ``pos(past + r) - pos(j) < window``, ``pos`` counting only the attended slots
  (``cumsum(attention_mask) - 1``: padding inside a row, where onnxruntime-genai puts it, is not
  counted; with left padding or none it is the slot distance). A masked score is the dtype's lowest
  finite value, so a padding row stays finite.

That is the ``decomposed`` attention form; ``ATTENTIONS`` holds the forms by name (``--onnx-attention``),
and ``gqa`` (``gqa.py``) lowers each causal ``sdpa`` to one ``com.microsoft.GroupQueryAttention`` instead.

Greedy decoding with it reproduces the full-sequence graph token for token (tests/test_onnx_decoder.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from qcompiler.backends.onnx.builder import ONNX_DTYPES, LowerError, Lowering, OnnxBuilder, result_type_of
from qcompiler.backends.onnx.lower_attention import attention, causal_keep, repeat_heads
from qcompiler.ir.core import Graph, Op, Value
from qcompiler.ir.kv import causal_lm_dims, is_position, per_row_positions, producers, repeat_source
from qcompiler.ir.ops.attention import Sdpa
from qcompiler.ir.ops.dense import Reshape
from qcompiler.ir.types import DenseType

ATTENTION_MASK, POSITION_IDS = "attention_mask", "position_ids"
DECOMPOSED = "decomposed"
"""The default attention form (``ATTENTIONS``)."""
BATCH, SEQ, PAST, TOTAL = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"
"""The symbolic dims of the signature (the names optimum's and onnxruntime-genai's exports use)."""


@dataclass
class Layer:
    past_key: str
    past_value: str
    present_key: str
    present_value: str
    kv_heads: int
    head_dim: int
    dtype: int


@dataclass(frozen=True)
class CachedAttention:
    """One causal ``sdpa`` of the decoder graph, as an attention form lowers it: its layer's cache
    names, the lowered query ``q`` ``[batch, heads, seq, head_dim]`` (rotated), the keys and values
    ``k``, ``v`` ``[batch, kv_heads, seq, head_dim]`` before the grouped-query repeat, and the repeats
    (``rep``: keys, values) that make ``heads`` of them."""

    op: Sdpa
    layer: Layer
    index: int
    q: str
    k: str
    v: str
    rep: tuple[int, int]
    heads: int


@dataclass
class KvCache:
    """The lowering hooks of the decoder graph (module docstring); ``layers`` are found while lowering."""

    g: Graph
    seq_dim: str
    batch_dim: str
    layers: list[Layer] = field(default_factory=list[Layer])
    made_by: dict[int, Op] = field(default_factory=dict[int, Op])
    per_row: set[int] = field(default_factory=set[int])
    keeps: dict[int | None, str] = field(default_factory=dict[int | None, str])
    form: str = DECOMPOSED
    """How each causal ``sdpa`` is lowered: a key of ``ATTENTIONS``."""
    shared: dict[str, str] = field(default_factory=dict[str, str])
    """Values an attention form computes once for every layer (``gqa.py``'s sequence lengths and bias)."""

    def __post_init__(self) -> None:
        self.made_by = producers(self.g)
        self.per_row = per_row_positions(self.g, self.seq_dim, self.batch_dim)

    def dim_params(self) -> dict[str, str]:
        """The IR's dims -> the signature's ``dim_param`` names."""
        return {self.batch_dim: BATCH, self.seq_dim: SEQ}

    def reserved(self) -> tuple[str, ...]:
        """Graph input names no lowered node may take."""
        return (ATTENTION_MASK, POSITION_IDS)

    def lowering(self, op: Op) -> Lowering | None:
        if is_position(op, self.seq_dim):
            return self.positions
        if isinstance(op, Sdpa) and op.causal:
            return self.attention
        rows = [v for v in op.operands if id(v) in self.per_row]
        if isinstance(op, Reshape) and rows:
            return self.per_row_reshape
        flat = [v.type for v in rows if isinstance(v.type, DenseType) and v.type.rank == 1]
        if flat and op.results and result_type_of(op.result).shape != flat[0].shape:  # not elementwise
            raise LowerError(f"{op.describe()}: reads the positions [?seq] as a whole; per-row positions do not fit it")
        return None

    def positions(self, b: OnnxBuilder, op: Op, xs: list[str]) -> str:
        return POSITION_IDS

    def per_row_reshape(self, b: OnnxBuilder, op: Op, xs: list[str]) -> str:
        """A reshape to ``[1, ...]`` of a value computed from the positions: ``[batch, ...]``."""
        shape = list(op.attrs["shape"])  # type: ignore[arg-type]
        if not shape or shape[0] != 1:
            raise LowerError(f"{op.describe()}: a reshape of the positions keeps a leading 1 (the batch, per row)")
        n = op.result.name
        return b.node("Reshape", [xs[0], b.shape([self.batch_dim, *shape[1:]], n)], n)

    def keep(self, b: OnnxBuilder, window: int | None) -> str:
        """bool ``[batch, 1, seq, total]``: the causal (and ``window``) rule and the attention mask."""
        if window in self.keeps:
            return self.keeps[window]
        hint = "attn_keep" if window is None else f"attn_keep_w{window}"
        total = b.node("Shape", [ATTENTION_MASK], f"{hint}_total", start=1, end=2)
        tri = causal_keep(b, b.dim(self.seq_dim), total, None, hint)
        axes = b.constant(np.array([1, 2], np.int64), f"{hint}_axes")
        attend = b.node("Cast", [ATTENTION_MASK], f"{hint}_attend", to=TensorProto.BOOL)
        padding = b.node("Unsqueeze", [attend, axes], f"{hint}_rows")
        keep = b.node("And", [tri, padding], hint if window is None else f"{hint}_causal")
        if window is not None:
            keep = b.node("And", [keep, self.within(b, total, window, hint)], hint)
        self.keeps[window] = keep
        return keep

    def within(self, b: OnnxBuilder, total: str, window: int, hint: str) -> str:
        """bool ``[batch, 1, seq, total]``: key ``j`` lies less than ``window`` positions before query
        ``r``, positions counted over the attended slots (``cumsum(attention_mask) - 1``), so padding
        inside a row (onnxruntime-genai pads on the right and generates after the padding) does not
        count; with left padding or none it is the slot distance."""
        if "key_positions" not in self.shared:
            mask = b.node("Cast", [ATTENTION_MASK], "attn_mask_i64", to=TensorProto.INT64)
            one = b.constant(np.array(1, np.int64), "attn_pos_one")
            summed = b.node("CumSum", [mask, b.constant(np.array(1, np.int64), "attn_pos_axis")], "attn_cumsum")
            self.shared["key_positions"] = b.node("Sub", [summed, one], "attn_key_positions")
        keys = self.shared["key_positions"]
        first = b.node("Sub", [total, b.dim(self.seq_dim)], f"{hint}_first")
        end = b.constant(np.array([np.iinfo(np.int64).max], np.int64), f"{hint}_end")
        axis = b.constant(np.array([1], np.int64), f"{hint}_axis1")
        queries = b.node("Slice", [keys, first, end, axis], f"{hint}_query_positions")
        q4 = b.node("Unsqueeze", [queries, b.constant(np.array([1, 3], np.int64), f"{hint}_q_axes")], f"{hint}_q4")
        k4 = b.node("Unsqueeze", [keys, b.constant(np.array([1, 2], np.int64), f"{hint}_k_axes")], f"{hint}_k4")
        distance = b.node("Sub", [q4, k4], f"{hint}_distance")
        return b.node("Less", [distance, b.constant(np.array(window, np.int64), f"{hint}_w")], f"{hint}_within")

    def source(self, v: Value) -> tuple[Value, int]:
        return repeat_source(self.made_by, v)

    def attention(self, b: OnnxBuilder, op: Op, xs: list[str]) -> str:
        if len(xs) > 3:
            raise LowerError(f"{op.describe()}: a masked causal attention has no KV-cache lowering")
        assert isinstance(op, Sdpa)  # the hook handles sdpa only
        i = len(self.layers)
        (k_src, k_rep), (v_src, v_rep) = self.source(op.k), self.source(op.v)
        k_t = result_type_of(k_src)
        kv_heads, head_dim = k_t.shape[1], k_t.shape[3]
        heads = result_type_of(op.q).shape[1]
        if not all(isinstance(d, int) for d in (kv_heads, head_dim, heads)):
            raise LowerError(f"{op.describe()}: heads and head_dim must be static")
        assert isinstance(kv_heads, int)
        assert isinstance(head_dim, int)
        assert isinstance(heads, int)
        layer = Layer(
            f"past_key_values.{i}.key",
            f"past_key_values.{i}.value",
            f"present.{i}.key",
            f"present.{i}.value",
            kv_heads,
            head_dim,
            ONNX_DTYPES[k_t.dtype.name],
        )
        self.layers.append(layer)
        b.taken.update((layer.past_key, layer.past_value, layer.present_key, layer.present_value))
        step = CachedAttention(op, layer, i, xs[0], b.name_of(k_src), b.name_of(v_src), (k_rep, v_rep), heads)
        return ATTENTIONS[self.form](self, b, step)

    def graph_inputs(self) -> list[onnx.ValueInfoProto]:
        """After ``input_ids``: the mask, the positions, then every layer's past key and value."""
        return [
            helper.make_tensor_value_info(ATTENTION_MASK, TensorProto.INT64, [BATCH, TOTAL]),
            helper.make_tensor_value_info(POSITION_IDS, TensorProto.INT64, [BATCH, SEQ]),
            *(
                helper.make_tensor_value_info(name, layer.dtype, [BATCH, layer.kv_heads, PAST, layer.head_dim])
                for layer in self.layers
                for name in (layer.past_key, layer.past_value)
            ),
        ]

    def graph_outputs(self) -> list[onnx.ValueInfoProto]:
        """After ``logits``: every layer's present key and value."""
        return [
            helper.make_tensor_value_info(name, layer.dtype, [BATCH, layer.kv_heads, TOTAL, layer.head_dim])
            for layer in self.layers
            for name in (layer.present_key, layer.present_value)
        ]


CacheAttention = Callable[[KvCache, OnnxBuilder, CachedAttention], str]
ATTENTIONS: dict[str, CacheAttention] = {}
"""The decoder graph's attention forms (``--onnx-attention``), filled by ``attention_form``: ``decomposed``
(the default, below) and ``gqa``, one ``com.microsoft.GroupQueryAttention`` node a layer (``gqa.py``)."""


def attention_form(name: str) -> Callable[[CacheAttention], CacheAttention]:
    def register(fn: CacheAttention) -> CacheAttention:
        ATTENTIONS[name] = fn
        return fn

    return register


@attention_form(DECOMPOSED)
def decomposed(kv: KvCache, b: OnnxBuilder, a: CachedAttention) -> str:
    """Plain ops: the cache ``Concat``-ed with the new keys and values (the presents), repeated over the
    query heads, then ``lower_attention.attention`` under the causal, window and padding mask."""
    layer, i = a.layer, a.index
    k_all = b.node("Concat", [layer.past_key, a.k], f"kv{i}_k", axis=2)
    v_all = b.node("Concat", [layer.past_value, a.v], f"kv{i}_v", axis=2)
    b.nodes.append(helper.make_node("Identity", [k_all], [layer.present_key], name=layer.present_key))
    b.nodes.append(helper.make_node("Identity", [v_all], [layer.present_value], name=layer.present_value))
    k = repeat_heads(b, k_all, a.rep[0], a.heads, layer.head_dim, f"kv{i}_krep")
    v = repeat_heads(b, v_all, a.rep[1], a.heads, layer.head_dim, f"kv{i}_vrep")
    return attention(b, a.op, a.q, k, v, None, False, kv.keep(b, a.op.window))


def kv_cache_for(g: Graph, form: str = DECOMPOSED) -> KvCache | None:
    """A ``KvCache`` for a causal LM graph (``input_ids [?batch, ?seq]`` in, causal sdpa inside), else None;
    ``form``: its attention form (a key of ``ATTENTIONS``)."""
    dims = causal_lm_dims(g)
    return None if dims is None else KvCache(g, dims[1], dims[0], form=form)


__all__ = ["ATTENTIONS", "ATTENTION_MASK", "POSITION_IDS", "CachedAttention", "KvCache", "kv_cache_for"]

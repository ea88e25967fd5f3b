"""The KV-cache variant of a causal LM graph: past key/values in, present key/values out.

The captured graph computes a whole sequence from positions ``0..seq``. The variant (``model_with_past.onnx``)
takes, for every attention layer ``i``, ``past_key_values.i.key``/``.value`` ``[batch, kv_heads, past, head_dim]``
(``past`` may be 0) and returns ``present.i.key``/``.value`` ``[batch, kv_heads, past + seq, head_dim]``:

- the position ``arange(0, ?seq)`` becomes ``Range(past, past + seq)``, so rotary embeddings continue;
- each causal ``sdpa``'s keys and values are traced back through their grouped-query repeat
  (``reshape -> expand -> reshape``) to the rotated ``[batch, kv_heads, seq, head_dim]`` tensors, which
  are appended to the cache (``Concat`` on axis 2) and repeated again over the query heads;
- the causal mask lets query row ``r`` see keys ``0..past + r``.

Greedy decoding with it reproduces the full-sequence graph token for token (tests/test_onnx_backend.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from qcompiler.backends.onnx.builder import ONNX_DTYPES, LowerError, Lowering, OnnxBuilder, result_type_of
from qcompiler.backends.onnx.lower_attention import attention, repeat_heads
from qcompiler.ir.core import Graph, Op, Value
from qcompiler.ir.kv import causal_lm_dims, is_position, producers, repeat_source
from qcompiler.ir.ops.attention import Sdpa


@dataclass
class Layer:
    past_key: str
    past_value: str
    present_key: str
    present_value: str
    kv_heads: int
    head_dim: int
    dtype: int


@dataclass
class KvCache:
    g: Graph
    seq_dim: str
    batch_dim: str
    layers: list[Layer] = field(default_factory=list[Layer])
    made_by: dict[int, Op] = field(default_factory=dict[int, Op])

    def __post_init__(self) -> None:
        self.made_by = producers(self.g)

    def lowering(self, op: Op) -> Lowering | None:
        if is_position(op, self.seq_dim):
            return self.positions
        if isinstance(op, Sdpa) and op.causal:
            return self.attention
        return None

    def past_length(self, b: OnnxBuilder) -> str:
        return b.node("Shape", ["past_key_values.0.key"], "past_length", start=2, end=3)

    def positions(self, b: OnnxBuilder, op: Op, xs: list[str]) -> str:
        axes = b.constant(np.array([0], np.int64), "pos_axes")
        past = b.node("Squeeze", [self.past_length(b), axes], "past_len")
        seq = b.node("Squeeze", [b.dim(self.seq_dim), axes], "seq_len")
        end = b.node("Add", [past, seq], "pos_end")
        return b.node("Range", [past, end, b.constant(np.array(1, np.int64), "pos_step")], op.result.name)

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
        k_all = b.node("Concat", [layer.past_key, b.name_of(k_src)], f"kv{i}_k", axis=2)
        v_all = b.node("Concat", [layer.past_value, b.name_of(v_src)], f"kv{i}_v", axis=2)
        b.nodes.append(helper.make_node("Identity", [k_all], [layer.present_key], name=layer.present_key))
        b.nodes.append(helper.make_node("Identity", [v_all], [layer.present_value], name=layer.present_value))
        k = repeat_heads(b, k_all, k_rep, heads, head_dim, f"kv{i}_krep")
        v = repeat_heads(b, v_all, v_rep, heads, head_dim, f"kv{i}_vrep")
        lengths = (
            b.node("Shape", [xs[0]], f"kv{i}_sq", start=2, end=3),
            b.node("Shape", [k_all], f"kv{i}_sk", start=2, end=3),
        )
        return attention(b, op, xs[0], k, v, None, False, lengths)

    def graph_inputs(self) -> list[onnx.ValueInfoProto]:
        batch = self.batch_dim.removeprefix("?")
        return [
            helper.make_tensor_value_info(name, layer.dtype, [batch, layer.kv_heads, "past", layer.head_dim])
            for layer in self.layers
            for name in (layer.past_key, layer.past_value)
        ]

    def graph_outputs(self, b: OnnxBuilder) -> list[onnx.ValueInfoProto]:
        batch = self.batch_dim.removeprefix("?")
        return [
            helper.make_tensor_value_info(name, layer.dtype, [batch, layer.kv_heads, "total", layer.head_dim])
            for layer in self.layers
            for name in (layer.present_key, layer.present_value)
        ]


def kv_cache_for(g: Graph) -> KvCache | None:
    """A ``KvCache`` for a causal LM graph (``input_ids [?batch, ?seq]`` in, causal sdpa inside), else None."""
    dims = causal_lm_dims(g)
    return None if dims is None else KvCache(g, dims[1], dims[0])


__all__ = ["KvCache", "TensorProto", "kv_cache_for"]

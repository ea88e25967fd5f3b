"""``--onnx-attention gqa``: each causal ``sdpa`` of the decoder graph as one
``com.microsoft.GroupQueryAttention`` node (onnxruntime's contrib op), so the cache is appended in place
and onnxruntime-genai can share the past and present buffers (``past_present_share_buffer: true``).

    q [B, H, S, D] (rotated) -> Transpose, Reshape -> query [B, S, H*D]
    k, v [B, KVH, S, D] (before the grouped-query repeat) -> key, value [B, S, KVH*D]
    GroupQueryAttention(query, key, value, past_key_values.i.key, past_key_values.i.value,
                        seqlens_k, total_sequence_length, -, -, -, attention_bias)
        {num_heads = H, kv_num_heads = KVH, scale, do_rotary = 0, local_window_size = -1, softcap?}
      -> output [B, S, H*D] -> Reshape, Transpose -> [B, H, S, D]; present.i.key, present.i.value

| input | made from ``attention_mask`` [B, T] (shared by the layers) |
|---|---|
| ``seqlens_k`` | int32 ``[B]``, ``T - 1`` in every row: the cache holds ``T`` positions, padding included |
| ``total_sequence_length`` | int32 scalar ``T`` |
| ``attention_bias`` | ``[B, 1, S, T]`` a window size: 0 where ``KvCache.keep`` keeps a key, else the lowest |

The kernel applies the causal rule by cache slot (query ``s`` at ``T - S + s``). Its own sliding
window (``local_window_size = w`` keeps keys ``j`` with ``T - S + s - j < w``, onnxruntime 1.32) counts
slots, padding included, so it is left off (-1) and the window is in the bias, counted over the
attended positions as the decomposed form counts it: a row that onnxruntime-genai padded on the
right keeps its window. ``KvCache.keep`` is the decomposed form's mask (causal, window,
``attention_mask``), and the lowest is the dtype's lowest finite value. A soft cap is the ``softcap``
attribute, applied before the bias. Padding is the bias, not ``seqlens_k``: onnxruntime reads
``seqlens_k`` as the last valid position of a right-padded row, so ``ReduceSum(attention_mask) - 1``
(what genai's own builder feeds) would drop a left-padded row's last tokens; every row here has
``T`` positions and its padding is masked by the bias, as the decomposed form masks it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto, helper

from qcompiler.backends.onnx.builder import LowerError, OnnxBuilder, result_type_of
from qcompiler.backends.onnx.kv_cache import ATTENTION_MASK, CachedAttention, KvCache, attention_form
from qcompiler.backends.onnx.lower_attention import LOWEST, lowest

GQA = "gqa"
OP = "GroupQueryAttention"
DOMAIN = "com.microsoft"
ATTRIBUTES = ("num_heads", "kv_num_heads", "scale", "do_rotary", "local_window_size", "softcap")
"""The attributes this lowering writes (the reader's nodes gate admits no other)."""
BIAS_INPUT = 10
"""``attention_bias``'s input index (after ``cos_cache``, ``sin_cache`` and ``position_ids``, left empty)."""
DTYPES = ("f32", "f16")
"""Activation dtypes onnxruntime's CPU kernel runs."""


def to_hidden(b: OnnxBuilder, x: str, width: int, hint: str) -> str:
    """``[B, N, S, D]`` -> ``[B, S, N*D]``."""
    t = b.node("Transpose", [x], f"{hint}_t", perm=[0, 2, 1, 3])
    return b.node("Reshape", [t, b.constant(np.array([0, 0, width], np.int64), f"{hint}_shape")], hint)


def mask_inputs(kv: KvCache, b: OnnxBuilder, a: CachedAttention) -> tuple[str, str, str]:
    """``seqlens_k`` and ``total_sequence_length`` (made once) and ``attention_bias`` (one per window
    size, from the decomposed form's mask: ``KvCache.keep``) for ``a`` (module docstring)."""
    if f"{GQA}_seqlens" not in kv.shared:
        total = b.node("Shape", [ATTENTION_MASK], "gqa_total_1d", start=1, end=2)
        batch = b.node("Shape", [ATTENTION_MASK], "gqa_batch", start=0, end=1)
        last = b.node("Sub", [total, b.constant(np.array([1], np.int64), "gqa_one")], "gqa_last")
        rows = b.node("Expand", [last, batch], "gqa_rows")
        kv.shared[f"{GQA}_seqlens"] = b.node("Cast", [rows], "gqa_seqlens_k", to=TensorProto.INT32)
        scalar = b.node("Squeeze", [total, b.constant(np.array([0], np.int64), "gqa_axes0")], "gqa_total_scalar")
        kv.shared[f"{GQA}_total"] = b.node("Cast", [scalar], "gqa_total_sequence_length", to=TensorProto.INT32)
    window = a.op.window
    key = f"{GQA}_bias" if window is None else f"{GQA}_bias_w{window}"
    if key not in kv.shared:
        kind = LOWEST[result_type_of(a.op.q).dtype.name]
        zero = b.constant(np.array(0, kind), f"{key}_zero")
        keep = kv.keep(b, window)
        kv.shared[key] = b.node("Where", [keep, zero, lowest(b, a.op, f"{key}_lowest")], f"{key}_attention_bias")
    return kv.shared[f"{GQA}_seqlens"], kv.shared[f"{GQA}_total"], kv.shared[key]


@attention_form(GQA)
def group_query_attention(kv: KvCache, b: OnnxBuilder, a: CachedAttention) -> str:
    """One ``GroupQueryAttention`` node for ``a`` (module docstring); its outputs are the presents."""
    op, layer = a.op, a.layer
    heads, kv_heads, head_dim = a.heads, layer.kv_heads, layer.head_dim
    dtype = result_type_of(op.q).dtype.name
    if dtype not in DTYPES:
        raise LowerError(f"{op.describe()}: GroupQueryAttention runs {' and '.join(DTYPES)} on CPU, not {dtype}")
    if heads % kv_heads or a.rep != (heads // kv_heads, heads // kv_heads):
        raise LowerError(
            f"{op.describe()}: GroupQueryAttention repeats each of {kv_heads} key/value heads "
            f"{heads // kv_heads} times; the graph repeats keys and values {a.rep[0]} and {a.rep[1]} times"
        )
    n = op.result.name
    query = to_hidden(b, a.q, heads * head_dim, f"{n}_query")
    key = to_hidden(b, a.k, kv_heads * head_dim, f"{n}_key")
    value = to_hidden(b, a.v, kv_heads * head_dim, f"{n}_value")
    seqlens, total, bias = mask_inputs(kv, b, a)
    scale = op.scale if op.scale is not None else 1.0 / float(np.sqrt(head_dim))
    attrs: dict[str, Any] = {
        "num_heads": heads,
        "kv_num_heads": kv_heads,
        "scale": float(np.float32(scale)),
        "do_rotary": 0,
        "local_window_size": -1,  # a sliding window is in the bias, by position (module docstring)
    }
    if op.softcap is not None:
        attrs["softcap"] = float(np.float32(op.softcap))
    past = [layer.past_key, layer.past_value, seqlens, total, "", "", ""]
    out = b.fresh(f"{n}_gqa")
    outputs = [out, layer.present_key, layer.present_value]
    b.nodes.append(helper.make_node(OP, [query, key, value, *past, bias], outputs, name=out, domain=DOMAIN, **attrs))
    split = b.constant(np.array([0, 0, heads, head_dim], np.int64), f"{n}_heads")
    return b.node("Transpose", [b.node("Reshape", [out, split], f"{n}_bshd")], n, perm=[0, 2, 1, 3])


__all__ = ["ATTRIBUTES", "BIAS_INPUT", "DOMAIN", "GQA", "OP", "group_query_attention"]

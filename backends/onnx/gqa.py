"""``--onnx-attention gqa``: each causal ``sdpa`` of the decoder graph as one
``com.microsoft.GroupQueryAttention`` node (onnxruntime's contrib op), so the cache is appended in place
and onnxruntime-genai can share the past and present buffers (``past_present_share_buffer: true``).

    q [B, H, S, D] (rotated) -> Transpose, Reshape -> query [B, S, H*D]
    k, v [B, KVH, S, D] (before the grouped-query repeat) -> key, value [B, S, KVH*D]
    GroupQueryAttention(query, key, value, past_key_values.i.key, past_key_values.i.value,
                        seqlens_k, total_sequence_length, -, -, -, attention_bias)
        {num_heads = H, kv_num_heads = KVH, scale, do_rotary = 0, local_window_size, softcap?}
      -> output [B, S, H*D] -> Reshape, Transpose -> [B, H, S, D]; present.i.key, present.i.value

| input | made from ``attention_mask`` [B, T] (shared by the layers) |
|---|---|
| ``seqlens_k`` | int32 ``[B]``, ``T - 1`` in every row: the cache holds ``T`` positions, padding included |
| ``total_sequence_length`` | int32 scalar ``T`` |
| ``attention_bias`` | ``[B, 1, S, T]``: 0 where the mask is 1, the dtype's lowest finite value where it is 0 |

The kernel applies the causal rule by absolute position (query ``s`` at ``T - S + s``) and, with
``local_window_size = w``, keeps keys ``j`` with ``T - S + s - j < w``: transformers' sliding window of
``w`` (onnxruntime 1.32; measured against the decomposed form). A soft cap is the ``softcap``
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
    """``seqlens_k``, ``total_sequence_length`` and ``attention_bias`` (module docstring), made once."""
    if f"{GQA}_bias" in kv.shared:
        return kv.shared[f"{GQA}_seqlens"], kv.shared[f"{GQA}_total"], kv.shared[f"{GQA}_bias"]
    total = b.node("Shape", [ATTENTION_MASK], "gqa_total_1d", start=1, end=2)
    batch = b.node("Shape", [ATTENTION_MASK], "gqa_batch", start=0, end=1)
    last = b.node("Sub", [total, b.constant(np.array([1], np.int64), "gqa_one")], "gqa_last")
    seqlens = b.node("Cast", [b.node("Expand", [last, batch], "gqa_rows")], "gqa_seqlens_k", to=TensorProto.INT32)
    axes0 = b.constant(np.array([0], np.int64), "gqa_axes0")
    scalar = b.node("Squeeze", [total, axes0], "gqa_total_scalar")
    total_i32 = b.node("Cast", [scalar], "gqa_total_sequence_length", to=TensorProto.INT32)
    kind = LOWEST[result_type_of(a.op.q).dtype.name]
    attend = b.node("Cast", [ATTENTION_MASK], "gqa_attend", to=TensorProto.BOOL)
    zero = b.constant(np.array(0, kind), "gqa_zero")
    rows = b.node("Where", [attend, zero, lowest(b, a.op, "gqa_lowest")], "gqa_bias_rows")
    unsqueezed = b.node("Unsqueeze", [rows, b.constant(np.array([1, 2], np.int64), "gqa_axes12")], "gqa_bias_b11t")
    one = b.constant(np.array([1], np.int64), "gqa_dim1")
    shape = b.node("Concat", [one, one, b.dim(kv.seq_dim), one], "gqa_bias_shape", axis=0)
    bias = b.node("Expand", [unsqueezed, shape], "gqa_attention_bias")
    kv.shared.update({f"{GQA}_seqlens": seqlens, f"{GQA}_total": total_i32, f"{GQA}_bias": bias})
    return seqlens, total_i32, bias


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
        "local_window_size": -1 if op.window is None else int(op.window),
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

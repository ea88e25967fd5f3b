"""ONNX lowerings of attention: rotary embeddings, grouped-query repeat and ``sdpa`` (see ``lower.py``)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from qcompiler.backends.onnx.builder import LowerError, OnnxBuilder, lowers, result_type, result_type_of
from qcompiler.ir.core import Op
from qcompiler.ir.ops.attention import Sdpa


@lowers("rotary")
def _rotary(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    if op.attrs.get("style") != "half":
        raise LowerError(f"{op.describe()}: only the rotate-half style is lowered (not {op.attrs.get('style')!r})")
    n = op.result.name
    half = int(result_type(op).shape[-1]) // 2  # type: ignore[arg-type]
    axis = b.constant(np.array([-1], np.int64), f"{n}_axis")
    bounds = ((half, "h"), (0, "0"), (1 << 62, "e"))
    cut, start, stop = (b.constant(np.array([v], np.int64), f"{n}_{w}") for v, w in bounds)
    x1 = b.node("Slice", [xs[0], start, cut, axis], f"{n}_x1")
    x2 = b.node("Slice", [xs[0], cut, stop, axis], f"{n}_x2")
    rotated = b.node("Concat", [b.node("Neg", [x2], f"{n}_neg"), x1], f"{n}_rot", axis=-1)
    return b.node("Add", [b.node("Mul", [xs[0], xs[1]], f"{n}_c"), b.node("Mul", [rotated, xs[2]], f"{n}_s")], n)


def repeat_heads(b: OnnxBuilder, x: str, rep: int, heads: int, head_dim: int, hint: str) -> str:
    """``[B, Hkv, T, D]`` -> ``[B, Hkv * rep, T, D]``, each key/value head repeated ``rep`` times (GQA)."""
    if rep == 1:
        return x
    axes = b.constant(np.array([2], np.int64), f"{hint}_axes")
    ones = b.constant(np.array([1, 1, rep, 1, 1], np.int64), f"{hint}_rep")
    expanded = b.node("Expand", [b.node("Unsqueeze", [x, axes], f"{hint}_u"), ones], f"{hint}_e")
    shape = b.constant(np.array([0, heads, -1, head_dim], np.int64), f"{hint}_shape")
    return b.node("Reshape", [expanded, shape], f"{hint}_r")


@lowers("sdpa")
def _sdpa(b: OnnxBuilder, op: Op, xs: list[str]) -> str:
    assert isinstance(op, Sdpa)  # lowers("sdpa") dispatches by name
    q_t, k_t = result_type_of(op.q), result_type_of(op.k)
    heads, kv_heads, head_dim = q_t.shape[1], k_t.shape[1], k_t.shape[3]
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and isinstance(head_dim, int)):
        raise LowerError(f"{op.describe()}: heads and head_dim must be static")
    k = repeat_heads(b, xs[1], heads // kv_heads, heads, head_dim, f"{op.result.name}_krep")
    v = repeat_heads(b, xs[2], heads // kv_heads, heads, head_dim, f"{op.result.name}_vrep")
    mask = xs[3] if len(xs) > 3 else None
    mask_bool = op.mask is not None and result_type_of(op.mask).dtype.name == "bool"
    lengths = (b.dim(q_t.shape[2]), b.dim(k_t.shape[2])) if op.attrs.get("causal") else None
    return attention(b, op, xs[0], k, v, mask, mask_bool, lengths)


def attention(
    b: OnnxBuilder,
    op: Sdpa,
    q: str,
    k: str,
    v: str,
    mask: str | None,
    mask_bool: bool,
    lengths: tuple[str, str] | None,
) -> str:
    """``softmax(q k^T * scale + mask) v``; ``lengths`` (int64 ``[1]`` query and key lengths) makes it
    causal, the last query row seeing every key (keys beyond the queries are a cache before them),
    and with ``op.window`` only the last ``window`` of them; ``op.softcap`` caps the scores first."""
    n = op.result.name
    q_t = result_type_of(op.q)
    scale = op.scale
    scale_f = scale if scale is not None else 1.0 / float(np.sqrt(int(q_t.shape[-1])))  # type: ignore[arg-type]
    scores = b.node("MatMul", [q, b.node("Transpose", [k], f"{n}_kT", perm=[0, 1, 3, 2])], f"{n}_qk")
    scores = b.node("Mul", [scores, b.constant(np.array(scale_f, np.float32), f"{n}_scale")], f"{n}_scores")
    if op.softcap is not None:
        cap = b.constant(np.array(op.softcap, np.float32), f"{n}_cap")
        scores = b.node("Mul", [b.node("Tanh", [b.node("Div", [scores, cap], f"{n}_d")], f"{n}_t"), cap], f"{n}_capped")
    neg_inf = b.constant(np.array(-np.inf, np.float32), f"{n}_neg_inf")
    if mask is not None:
        scores = b.node(
            "Where" if mask_bool else "Add", [mask, scores, neg_inf] if mask_bool else [scores, mask], f"{n}_m"
        )
    if lengths is not None:
        ones = b.node(
            "ConstantOfShape",
            [b.node("Concat", list(lengths), f"{n}_sq_sk", axis=0)],
            f"{n}_ones",
            value=numpy_helper.from_array(np.array([1], np.int64), "value"),
        )
        axes = b.constant(np.array([0], np.int64), f"{n}_axes")
        sk, sq = (
            b.node("Squeeze", [d, axes], f"{n}_{w}") for d, w in zip(reversed(lengths), ("sk", "sq"), strict=True)
        )
        diag = b.node("Sub", [sk, sq], f"{n}_diag")
        tri = b.node("Trilu", [ones, diag], f"{n}_tri", upper=0)
        if op.window is not None:  # and j >= i + diag - window + 1: the last `window` keys only
            low = b.node("Sub", [diag, b.constant(np.array(op.window - 1, np.int64), f"{n}_w")], f"{n}_low")
            tri = b.node("Trilu", [tri, low], f"{n}_band", upper=1)
        tri = b.node("Cast", [tri], f"{n}_keep", to=TensorProto.BOOL)
        scores = b.node("Where", [tri, scores, neg_inf], f"{n}_causal")
    probs = b.node("Softmax", [scores], f"{n}_probs", axis=-1)
    return b.node("MatMul", [probs, v], n)

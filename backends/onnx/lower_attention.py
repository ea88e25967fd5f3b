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


LOWEST: dict[str, type[np.floating]] = {"f32": np.float32, "f16": np.float16, "f64": np.float64}
"""Score dtypes and the numpy type whose lowest finite value masks a score out (as transformers does:
a row with every key masked, a padding query, stays finite where -inf would give NaN)."""


def lowest(b: OnnxBuilder, op: Op, hint: str) -> str:
    """The lowest finite value of ``op``'s score dtype, as a scalar constant."""
    dtype = result_type_of(op.operands[0]).dtype.name
    if dtype not in LOWEST:
        raise LowerError(f"{op.describe()}: attention scores of {dtype} are not lowered (known: {sorted(LOWEST)})")
    kind = LOWEST[dtype]
    return b.constant(np.array(np.finfo(kind).min, kind), hint)


def causal_keep(b: OnnxBuilder, sq: str, sk: str, window: int | None, hint: str) -> str:
    """bool ``[sq, sk]`` (``sq``, ``sk``: int64 ``[1]`` query and key lengths): query row ``r`` is at
    position ``sk - sq + r`` (the keys before the queries are a cache) and sees key ``j`` when
    ``j <= sk - sq + r``; with ``window``, only when also ``sk - sq + r - j < window``."""
    ones = b.node(
        "ConstantOfShape",
        [b.node("Concat", [sq, sk], f"{hint}_sq_sk", axis=0)],
        f"{hint}_ones",
        value=numpy_helper.from_array(np.array([1], np.int64), "value"),
    )
    axes = b.constant(np.array([0], np.int64), f"{hint}_axes")
    k_len, q_len = (b.node("Squeeze", [d, axes], f"{hint}_{w}") for d, w in ((sk, "sk"), (sq, "sq")))
    diag = b.node("Sub", [k_len, q_len], f"{hint}_diag")
    tri = b.node("Trilu", [ones, diag], f"{hint}_tri", upper=0)
    if window is not None:  # and j >= i + diag - window + 1: the last `window` keys only
        low = b.node("Sub", [diag, b.constant(np.array(window - 1, np.int64), f"{hint}_w")], f"{hint}_low")
        tri = b.node("Trilu", [tri, low], f"{hint}_band", upper=1)
    return b.node("Cast", [tri], f"{hint}_keep", to=TensorProto.BOOL)


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
    keep = None
    if op.causal:
        keep = causal_keep(b, b.dim(q_t.shape[2]), b.dim(k_t.shape[2]), op.window, op.result.name)
    return attention(b, op, xs[0], k, v, mask, mask_bool, keep)


def attention(
    b: OnnxBuilder,
    op: Sdpa,
    q: str,
    k: str,
    v: str,
    mask: str | None,
    mask_bool: bool,
    keep: str | None,
) -> str:
    """``softmax(q k^T * scale + mask) v``; ``op.softcap`` caps the scores first; ``keep`` (bool,
    broadcast over the scores: ``causal_keep``, or the KV-cache graph's causal and padding mask)
    sets the scores it does not keep to the dtype's lowest finite value."""
    n = op.result.name
    q_t = result_type_of(op.q)
    scale = op.scale
    scale_f = scale if scale is not None else 1.0 / float(np.sqrt(int(q_t.shape[-1])))  # type: ignore[arg-type]
    scores = b.node("MatMul", [q, b.node("Transpose", [k], f"{n}_kT", perm=[0, 1, 3, 2])], f"{n}_qk")
    scores = b.node("Mul", [scores, b.constant(np.array(scale_f, np.float32), f"{n}_scale")], f"{n}_scores")
    if op.softcap is not None:
        cap = b.constant(np.array(op.softcap, np.float32), f"{n}_cap")
        scores = b.node("Mul", [b.node("Tanh", [b.node("Div", [scores, cap], f"{n}_d")], f"{n}_t"), cap], f"{n}_capped")
    if mask is not None:
        scores = b.node(
            "Where" if mask_bool else "Add",
            [mask, scores, lowest(b, op, f"{n}_lowest")] if mask_bool else [scores, mask],
            f"{n}_m",
        )
    if keep is not None:
        scores = b.node("Where", [keep, scores, lowest(b, op, f"{n}_lowest")], f"{n}_causal")
    probs = b.node("Softmax", [scores], f"{n}_probs", axis=-1)
    return b.node("MatMul", [probs, v], n)

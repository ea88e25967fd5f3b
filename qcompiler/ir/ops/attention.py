"""Attention ops: rotary position embedding and scaled dot-product attention.

Both use the one generic syntax ``%r = name(%a, %b) {attrs} : result-types`` (see ``dense``).
"""

from __future__ import annotations

from qcompiler.ir.core import Op, attr, operand, optional_attr, optional_operand
from qcompiler.ir.ops.shapes import broadcast, dense, fail, shapes_match
from qcompiler.ir.types import DenseType, Type, is_dynamic


class Rotary(Op, name="rotary"):
    """Rotary position embedding of ``x`` ``[B, H, S, D]`` with ``cos``/``sin`` tables broadcastable to it.

    ``style`` is ``half`` (rotate_half, HF Llama) or ``interleaved`` (GPT-J pairs).

    ``%qr = rotary(%q, %cos, %sin) {style = "half"} : tensor<f32[1,4,?seq,16]>``
    """

    x = operand("float")
    cos = operand("float")
    sin = operand("float")
    style = attr(str, choices=("half", "interleaved"))

    def infer(self) -> list[Type]:
        x = dense(self.x)
        for v in (self.cos, self.sin):
            if broadcast(self, x.shape, dense(v).shape) != x.shape and x.is_static:
                raise fail(self, "cos/sin", "table does not broadcast to x", x.short(), dense(v).short())
        return [x]


class Sdpa(Op, name="sdpa"):
    """Scaled dot-product attention; ``q`` ``[B, H, S, D]``, ``k``/``v`` ``[B, Hkv, T, D]`` with ``H % Hkv == 0`` (GQA).

    ``%o = sdpa(%q, %k, %v) {causal = true, scale = 0.25} : tensor<f32[1,4,?seq,16]>``
    """

    q = operand("float")
    k = operand("float")
    v = operand("float")
    mask = optional_operand("dense")
    causal = attr(bool)
    scale = optional_attr(float)

    def infer(self) -> list[Type]:
        q, k, v = dense(self.q), dense(self.k), dense(self.v)
        if not q.rank == k.rank == v.rank == 4:
            raise fail(
                self, "operands", "q, k, v must be rank 4 [B, H, S, D]", "rank 4", f"{q.rank}, {k.rank}, {v.rank}"
            )
        hq, hk = q.shape[1], k.shape[1]
        if hk == 0:
            raise fail(self, "k", "key/value heads must be at least one", ">= 1", hk)
        if not (is_dynamic(hq) or is_dynamic(hk)) and int(hq) % int(hk) != 0:
            raise fail(self, "k", "query heads must be a multiple of key/value heads", f"divisor of {hq}", hk)
        if not shapes_match(q.shape[-1:], k.shape[-1:]):
            raise fail(self, "k", "head dims of q and k differ", q.shape[-1], k.shape[-1])
        return [DenseType(q.dtype, (*q.shape[:3], v.shape[3]))]


__all__ = ["Rotary", "Sdpa"]

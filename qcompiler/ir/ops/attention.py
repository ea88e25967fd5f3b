"""Attention ops: rotary position embedding and scaled dot-product attention.

Both use the one generic syntax ``%r = name(%a, %b) {attrs} : result-types`` (see ``dense``).
"""

from __future__ import annotations

import torch

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

    ``causal``: query ``i`` (at position ``i + T - S``: keys beyond the queries are a cache before
    them) sees keys ``j <= i + T - S``. ``window`` (causal only): it also sees only the last ``window``
    of them, ``i + T - S - j < window`` (sliding-window attention: Mistral, Gemma2/3, Phi-3).
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the mask (Gemma2).

    ``%o = sdpa(%q, %k, %v) {causal = true, scale = 0.25, window = 4096} : tensor<f32[1,4,?seq,16]>``
    """

    q = operand("float")
    k = operand("float")
    v = operand("float")
    mask = optional_operand("dense")
    causal = attr(bool)
    scale = optional_attr(float)
    window = optional_attr(int)
    softcap = optional_attr(float)

    def infer(self) -> list[Type]:
        q, k, v = dense(self.q), dense(self.k), dense(self.v)
        if self.window is not None and (self.window < 1 or not self.causal):
            raise fail(
                self, "window", "a sliding window is a positive size on a causal sdpa", ">= 1, causal", self.window
            )
        if self.softcap is not None and not self.softcap > 0:
            raise fail(self, "softcap", "a soft cap is positive", "> 0", self.softcap)
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


def keep_mask(s_q: int, s_k: int, window: int | None, device: torch.device | None = None) -> torch.Tensor:
    """``[s_q, s_k]`` bool: which keys each query of a causal ``sdpa`` sees (``Sdpa``'s docstring)."""
    i = torch.arange(s_q, device=device)[:, None] + (s_k - s_q)
    j = torch.arange(s_k, device=device)[None, :]
    keep = j <= i
    return keep & (i - j < window) if window is not None else keep


__all__ = ["Rotary", "Sdpa", "keep_mask"]

"""``qcompiler::softcapped_sdpa``: attention with soft-capped scores (Gemma2's
``attn_logit_softcapping``) as one torch op, so that ``torch.export`` keeps it as one node.

torch's ``scaled_dot_product_attention`` has no soft cap, and transformers' eager attention spells
it as ``matmul``, ``mul``, ``div``, ``tanh``, ``mul``, ``add`` (the mask), ``softmax`` and ``matmul``.
This op computes exactly that sequence (``eager``); its fake implementation gives the shape alone,
so the exported program holds one ``qcompiler.softcapped_sdpa`` node, which lowers to QIR's
``sdpa {softcap = C}`` with the mask recognised as for torch's SDPA (``masks.py``):

``%o = sdpa(%q, %k, %v) {causal = true, scale = 0.25, softcap = 50.0, window = 4096} : tensor<f32[1,8,?seq,256]>``

``q`` is ``[B, H, S, D]``; ``k`` and ``v`` are ``[B, H, T, D]`` (key/value heads already repeated,
as transformers' eager attention repeats them); ``mask`` is an additive float mask (transformers'
eager masks: 0 where a query may attend, the dtype's minimum elsewhere) or a boolean keep mask.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("qcompiler::softcapped_sdpa", mutates_args=())
def softcapped_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float
) -> torch.Tensor:
    """``softmax(tanh(q @ k^T * scale / softcap) * softcap + mask) @ v``, in transformers' eager order
    (the softmax in float32, cast back to ``q``'s dtype)."""
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    elif mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


@softcapped_sdpa.register_fake
def _softcapped_sdpa_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float
) -> torch.Tensor:
    return q.new_empty((*q.shape[:3], v.shape[-1]))


SOFTCAPPED = torch.ops.qcompiler.softcapped_sdpa.default
"""The op's overload, as exported programs name it."""

__all__ = ["SOFTCAPPED", "softcapped_sdpa"]

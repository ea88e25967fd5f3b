"""A causal LM's KV cache: per layer, keys and values ``[batch, kv_heads, capacity, head_dim]`` allocated
once and written in place, with attention over the filled prefix.

``reserve(total)`` sizes every layer's buffer for ``total`` positions before they are allocated (``generate``
knows its length); a step that runs past the capacity doubles it (one copy of the filled prefix). The
keys and values are the tensors *before* the grouped-query repeat (``qcompiler.ir.kv.repeat_source``):
attention repeats them over the query heads inside ``scaled_dot_product_attention`` (``enable_gqa``)
instead of materialising the repeat on every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from qcompiler.ir.interpret import InterpretError, attend
from qcompiler.ir.ops.attention import Sdpa, keep_mask

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class KVCache:
    layers: dict[int, KV] = field(default_factory=dict[int, KV])
    """Layer (causal sdpa index) -> the key and value buffers, ``capacity`` positions each."""
    past: int = 0
    """Positions filled by committed steps; a step writes ``[past, past + new)`` and attends to ``[0, past + new)``."""
    want: int = 0
    """The capacity a buffer is allocated with (``reserve``), at least what the step needs."""

    def reserve(self, total: int) -> None:
        self.want = max(self.want, total)
        for layer, (k, _) in list(self.layers.items()):
            if k.shape[2] < total:
                self.layers[layer] = self.grown(layer, total)

    def grown(self, layer: int, need: int) -> KV:
        k, v = self.layers[layer]
        cap = max(need, self.want, 2 * k.shape[2])
        return self.copy_prefix(k, cap), self.copy_prefix(v, cap)

    def copy_prefix(self, old: torch.Tensor, cap: int) -> torch.Tensor:
        buf = empty_like_cap(old, cap)
        buf[:, :, : self.past].copy_(old[:, :, : self.past])
        return buf

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> KV:
        """Store this step's keys and values at ``[past, past + new)``; the filled prefix ``[0, past + new)``."""
        end = self.past + k_new.shape[2]
        held = self.layers.get(layer)
        if held is None:
            cap = max(end, self.want)
            held = (
                k_new.new_empty(*k_new.shape[:2], cap, k_new.shape[3]),
                v_new.new_empty(*v_new.shape[:2], cap, v_new.shape[3]),
            )
        elif held[0].shape[:2] != k_new.shape[:2] or held[0].dtype != k_new.dtype:
            raise InterpretError(
                f"KV cache layer {layer}: the cache holds batch x heads {list(held[0].shape[:2])} "
                f"({held[0].dtype}), this step's keys are {list(k_new.shape[:2])} ({k_new.dtype})"
            )
        elif held[0].shape[2] < end:
            held = self.grown(layer, end)
        self.layers[layer] = held
        held[0][:, :, self.past : end].copy_(k_new)
        held[1][:, :, self.past : end].copy_(v_new)
        return held[0][:, :, :end], held[1][:, :, :end]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.layers.values() for t in kv)


def empty_like_cap(x: torch.Tensor, cap: int) -> torch.Tensor:
    """A ``[batch, heads, cap, dim]`` buffer for values shaped like ``x``."""
    return x.new_empty(*x.shape[:2], cap, x.shape[3])


def attend_cached(
    cache: KVCache, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, op: Sdpa
) -> torch.Tensor:
    """A causal ``sdpa`` over the cached keys and this step's: the queries are the last ``new`` positions."""
    k, v = cache.write(layer, k_new, v_new)
    n_q, n_k = q.shape[-2], k.shape[-2]
    rep = q.shape[1] // k.shape[1]
    if op.softcap is not None:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return attend(op, q, k, v, keep_mask(n_q, n_k, op.window, q.device))
    if op.window is None and n_q == 1:  # one query sees every cached key
        mask, causal = None, False
    elif op.window is None and n_q == n_k:  # a first prefill: the plain causal triangle
        mask, causal = None, True
    else:
        mask, causal = keep_mask(n_q, n_k, op.window, q.device), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=op.scale, enable_gqa=rep > 1)


def positions(cache: KVCache, new: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The rotary positions of this step's tokens: they continue from the cache length."""
    return torch.arange(cache.past, cache.past + new, dtype=dtype, device=device)

"""transformers' attention, as ``torch.export`` should see it: Gemma2's soft-capped attention through
``qcompiler::softcapped_sdpa`` (``softcap.py``).

transformers dispatches attention by name (``config._attn_implementation``, looked up in its
``AttentionInterface``; masks in its ``AttentionMaskInterface``). ``softcapped_attention(config)``
registers ``qcompiler_softcap`` in both and selects it while a model whose config declares
``attn_logit_softcapping`` is exported (a Gemma2 without the cap too: transformers gives Gemma2 no
SDPA, so its attention is eager, which the frontend does not recognise), then puts the model's own
choice back. The attention repeats
the key/value heads as transformers' eager attention does (``repeat_kv``: the graph's
``reshape -> expand -> reshape``, which KV-cache targets look through) and calls the op with the
layer's scale and cap; the masks are transformers' eager masks (additive float, never skipped),
so the op sees what eager attention sees and computes what it computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import torch

from qcompiler.frontend.softcap import softcapped_sdpa

NAME = "qcompiler_softcap"
"""The attention implementation's name in transformers' interfaces."""


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv, T, D]`` -> ``[B, Hkv * groups, T, D]``, each key/value head repeated for its queries."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None, :, :].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``[B, S, H, D]`` out, no attention weights."""
    groups = int(getattr(module, "num_key_value_groups", 1))
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    if softcap is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scale)
    else:
        out = softcapped_sdpa(query, key, value, attention_mask, scale, float(softcap))
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """``qcompiler_softcap`` in transformers' attention and mask interfaces (eager masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)


def wants_ours(config: Any) -> bool:
    """Whether a model of ``config`` exports through ``attention``: it soft-caps attention, or it could
    (its config has the field) and attends eagerly (then ``attention`` is SDPA on eager's masks)."""
    if config is None or not hasattr(config, "attn_logit_softcapping"):
        return False
    return bool(config.attn_logit_softcapping) or config._attn_implementation == "eager"


@contextlib.contextmanager
def softcapped_attention(config: Any) -> Generator[None]:
    """While it lasts, a transformers model of ``config`` that ``wants_ours`` attends through
    ``attention`` (``qcompiler::softcapped_sdpa`` when capped); anything else is left as it is."""
    if not wants_ours(config):
        yield
        return
    register()
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before


__all__ = ["NAME", "attention", "register", "softcapped_attention", "wants_ours"]

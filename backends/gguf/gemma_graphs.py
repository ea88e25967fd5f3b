"""What llama.cpp's gemma2 and gemma3 graphs fix rather than read from the file, checked against a
transformers config before anything is captured (``archs.refusal``): a config that says otherwise
would run as another model there, so the gguf target refuses it, naming the config.json field.

| graph | fixed in llama.cpp | config.json field |
|---|---|---|
| gemma2 | layers 0, 2, 4 ... slide, the others are full | ``layer_types`` |
| gemma2 | scores and logits always soft-capped (50, 30 if unset) | ``*_logit_softcapping`` |
| gemma2 | a window of 4096 if unset | ``sliding_window`` |
| both | queries scaled by ``head_dim ** -0.5`` (27B: ``hidden / heads``) | ``query_pre_attn_scalar`` |
| gemma2 | one default RoPE | ``rope_parameters`` |
| gemma3 | every sixth layer full; sliding layers' RoPE default, base 10000 | ``layer_types``, ``rope_parameters`` |
"""

from __future__ import annotations

from typing import Any

GEMMA3_LOCAL = {"rope_type": "default", "rope_theta": 10000.0}
"""llama.cpp's gemma3 graph: the sliding layers' RoPE (fixed, not read from the file)."""
GEMMA3_PATTERN = 6
"""llama.cpp's gemma3 graph: every sixth layer is full attention, the others slide (fixed)."""
GEMMA2_PATTERN = 2
"""llama.cpp's gemma2 graph: every second layer is full attention, the others slide (fixed)."""
LARGEST = {"gemma2": 46, "gemma3": 62}
"""Layer counts of the 27B models, whose queries llama.cpp scales by ``(hidden / heads) ** -0.5``."""

Check = tuple[str, bool, str]
"""(config.json field, whether the config follows the graph, what the graph needs)."""


def layer_pattern(layers: int, every: int) -> list[str]:
    """transformers' ``layer_types`` of a graph whose every ``every``-th layer is full."""
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]


def query_scale_check(arch: str, cfg: dict[str, Any]) -> Check:
    """``query_pre_attn_scalar`` as llama.cpp's graph for ``arch`` scales queries."""
    layers, head_dim, scalar = (
        int(cfg.get("num_hidden_layers") or 0),
        cfg.get("head_dim"),
        cfg.get("query_pre_attn_scalar"),
    )
    heads, hidden = int(cfg.get("num_attention_heads") or 1), int(cfg.get("hidden_size") or 0)
    ok = scalar in (None, head_dim) or (layers == LARGEST[arch] and scalar == hidden // heads)
    return ("query_pre_attn_scalar", ok, f"head_dim ({head_dim})")


def first_refused(arch: str, checks: tuple[Check, ...]) -> str:
    for field, ok, want in checks:
        if not ok:
            return f"target gguf: llama.cpp's {arch} graph fixes config.json's {field} (it needs {want})"
    return ""


def gemma2_refusal(cfg: dict[str, Any]) -> str:
    """What llama.cpp's gemma2 graph fixes and this config does not follow ("" when it does)."""
    pattern = layer_pattern(int(cfg.get("num_hidden_layers") or 0), GEMMA2_PATTERN)
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    capped = ("attn_logit_softcapping", "final_logit_softcapping")
    cap = "a positive soft cap: it always caps"
    checks: tuple[Check, ...] = (
        ("layer_types", cfg.get("layer_types", pattern) == pattern, "layers 0, 2, 4 ... sliding, the others full"),
        *((c, isinstance(cfg.get(c), int | float) and cfg[c] > 0, cap) for c in capped),
        ("sliding_window", isinstance(cfg.get("sliding_window"), int), "a window: it always slides (4096 if unset)"),
        query_scale_check("gemma2", cfg),
        ("rope_parameters", rope in ("default", None), "default RoPE (no scaling)"),
    )
    return first_refused("gemma2", checks)


def gemma3_refusal(cfg: dict[str, Any]) -> str:
    """What llama.cpp's gemma3 graph fixes and this config does not follow ("" when it does)."""
    pattern = layer_pattern(int(cfg.get("num_hidden_layers") or 0), GEMMA3_PATTERN)
    params = cfg.get("rope_parameters") or {}
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    full = params.get("full_attention") if isinstance(params, dict) else None
    checks: tuple[Check, ...] = (
        ("layer_types", cfg.get("layer_types", pattern) == pattern, f"every {GEMMA3_PATTERN}th layer full"),
        ("rope_parameters.sliding_attention", not isinstance(local, dict) or all(
            float(local.get(k, v)) == v if k == "rope_theta" else local.get(k, v) == v for k, v in GEMMA3_LOCAL.items()
        ), "default RoPE of base 10000"),
        ("rope_parameters.full_attention", not isinstance(full, dict) or full.get("rope_type", "default") == "default",
         "default RoPE (no scaling)"),
        query_scale_check("gemma3", cfg),
    )  # fmt: skip
    return first_refused("gemma3", checks)


__all__ = ["GEMMA2_PATTERN", "GEMMA3_LOCAL", "GEMMA3_PATTERN", "gemma2_refusal", "gemma3_refusal"]

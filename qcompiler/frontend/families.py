"""The transformers model families an HF-style directory may hold, by config.json ``model_type``.

Each family here compiles to the targets docs/architectures.md lists for it, and each cell of that
table is tested. A directory of any other family is refused when its config.json is read, before
anything is built or captured, naming the family and listing these (``check_family``): OPT, ViT, T5
and the rest would otherwise stop later, at the first op or weight the frontend does not know, with a
message about that op rather than about the model."""

from __future__ import annotations

FAMILIES: dict[str, str] = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen3": "Qwen3",
    "gemma": "Gemma",
    "gemma2": "Gemma2",
    "gemma3_text": "Gemma3 text",
    "phi3": "Phi-3 / Phi-4",
    "gpt2": "GPT-2",
    "mixtral": "Mixtral",
    "qwen2_moe": "Qwen2-MoE",
    "qwen3_moe": "Qwen3-MoE",
    "bert": "BERT",
}
"""config.json ``model_type`` -> the family's name in docs/architectures.md."""


def family_refusal(model_type: str, architectures: object) -> str:
    """Why a directory of ``model_type`` is not compiled ("" when its family is supported)."""
    if model_type in FAMILIES:
        return ""
    names = ", ".join(f"{name} ({t})" for t, name in FAMILIES.items())
    found = architectures[0] if isinstance(architectures, list) and architectures else model_type
    return f"{found} is not a supported model family; supported (model_type): {names}"

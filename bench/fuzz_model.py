"""A smaller source model for ``bench/fuzz.py --model fuzz_model:llama_1layer``: the tiny Llama of
``qcompiler.examples`` with one decoder layer instead of two (every tensor kind, half the graph)."""

from __future__ import annotations

from typing import Any


def llama_1layer(seed: int = 0) -> Any:
    """A seeded float ``LlamaForCausalLM``: vocab 128, hidden 64, FFN 128, one layer, 4 heads over 2."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg).eval()

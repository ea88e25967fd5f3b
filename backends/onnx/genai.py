"""``genai_config.json``: what onnxruntime-genai's ``og.Model(DIR)`` reads to run the decoder graph.

Built from tables, the source's config (special token ids, context length), the facts ``graph.qir``
states (layers, heads, head size, hidden size, vocabulary: ``package_facts.GraphFacts``) and the names the
written decoder graph has. The reader builds it again from the same inputs and requires the file to
say exactly that (``package_check.py``).

    {"model": {"type": "llama", "context_length": 128, "bos_token_id": 0, "eos_token_id": 1,
               "pad_token_id": 1, "vocab_size": 299,
               "decoder": {"filename": "model.onnx", "head_size": 16, "hidden_size": 64,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                           "inputs": {"input_ids": "input_ids",
                                      "past_key_names": "past_key_values.%d.key", ...},
                           "outputs": {"logits": "logits", "present_key_names": "present.%d.key", ...},
                           "session_options": {"log_id": "qcompiler", "provider_options": [],
                                               "session.qdq_matmulnbits_accuracy_level": "1"}}},
     "search": {"do_sample": false, "num_beams": 1, "max_length": 128, "top_k": 1, ...}}
"""

from __future__ import annotations

from typing import Any

import onnx

from qcompiler.backends.onnx import gqa
from qcompiler.backends.onnx.package_facts import GraphFacts, config_facts
from qcompiler.backends.onnx.weights import MODEL_FILE

DECODER_FILE = MODEL_FILE
"""The decoder graph onnxruntime-genai runs: the one with past/present key-values (the only name the
package code knows; everything else is read from the written model)."""
FILE = "genai_config.json"
TESTED = "0.18.0"
"""The onnxruntime-genai version the tests run these artifacts with."""

GENAI_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3_text",
    "phi3": "phi3",
    "mixtral": "decoder",
    "qwen2_moe": "decoder",
    "qwen3_moe": "decoder",
}
"""transformers ``model_type`` -> onnxruntime-genai's ``model.type`` (each a decoder-only type of its
``ModelType::IsLLM`` list, which all run the same decoder state machine over the graph's own
inputs and outputs). The mixtures of experts get ``decoder``, genai's generic decoder-only type:
0.18 has no type of their own, and their graph carries the experts itself. GPT-2's ``gpt2`` runs
another state machine (untested), and BERT is no causal LM: their artifacts carry no
genai_config.json."""

INPUTS = (
    ("input_ids", "input_ids"),
    ("attention_mask", "attention_mask"),
    ("position_ids", "position_ids"),
    ("past_key_names", "past_key_values.%d.key"),
    ("past_value_names", "past_key_values.%d.value"),
)
"""genai's ``decoder.inputs`` key -> the graph input name (``%d``: the layer); written when the graph has it."""
OUTPUTS = (
    ("logits", "logits"),
    ("present_key_names", "present.%d.key"),
    ("present_value_names", "present.%d.value"),
)
SEARCH: dict[str, Any] = {
    "diversity_penalty": 0.0,
    "do_sample": False,
    "early_stopping": True,
    "length_penalty": 1.0,
    "min_length": 0,
    "no_repeat_ngram_size": 0,
    "num_beams": 1,
    "num_return_sequences": 1,
    "past_present_share_buffer": False,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_k": 1,
    "top_p": 1.0,
}
"""Greedy search; ``max_length`` is the context length. ``past_present_share_buffer`` is what
``shares_buffer`` says of the written graph: a decomposed graph concatenates its cache, so the past
and present buffers are not shared; a GroupQueryAttention graph appends in place, and shares them."""
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def shares_buffer(decoder: onnx.ModelProto) -> bool:
    """Whether genai may run ``decoder`` with one buffer for each layer's past and present key/value:
    its attention is ``com.microsoft.GroupQueryAttention``, which writes the new positions into the
    past buffer (``--onnx-attention gqa``)."""
    return any(n.op_type == gqa.OP and n.domain == gqa.DOMAIN for n in decoder.graph.node)


def genai_type(config: dict[str, Any], causal: bool) -> tuple[str | None, str]:
    """genai's ``model.type`` for a source config, or None and why there is none."""
    model_type = config.get("model_type")
    if not causal:
        return None, "not a causal LM graph"
    if model_type not in GENAI_TYPES:
        return None, f"onnxruntime-genai {TESTED} has no decoder model type for {model_type!r}"
    return GENAI_TYPES[str(model_type)], ""


def names(pattern: str, layers: int) -> list[str]:
    return [pattern % i for i in range(layers)] if "%d" in pattern else [pattern]


def io_names(graph_names: set[str], table: tuple[tuple[str, str], ...], layers: int) -> dict[str, str]:
    """The table's entries whose (first) name the graph has."""
    return {key: pattern for key, pattern in table if names(pattern, layers)[0] in graph_names}


def token_ids(config: dict[str, Any], generation: dict[str, Any]) -> dict[str, Any]:
    """bos/eos/pad from config.json, overridden by generation_config.json (as genai's builder does);
    pad defaults to the first eos; ids that are unknown are left out (genai refuses ``null``)."""
    ids = {k: generation.get(k) if generation.get(k) is not None else config.get(k) for k in TOKEN_IDS}
    eos = ids["eos_token_id"]
    if ids["pad_token_id"] is None and eos is not None:
        ids["pad_token_id"] = eos[0] if isinstance(eos, list) and eos else eos
    return {k: v for k, v in ids.items() if v is not None}


def genai_config(
    config: dict[str, Any],
    generation: dict[str, Any],
    facts: GraphFacts,
    decoder: onnx.ModelProto,
    accuracy_level: int,
) -> dict[str, Any] | None:
    """The genai_config.json document, or None when genai has no type for the model."""
    kind, _ = genai_type(config, facts.causal)
    if kind is None:
        return None
    inputs = {i.name for i in decoder.graph.input}
    outputs = {o.name for o in decoder.graph.output}
    context = config_facts(config).get("context")
    return {
        "model": {
            "type": kind,
            "context_length": context,
            "vocab_size": facts.vocab,
            **token_ids(config, generation),
            "decoder": {
                "filename": DECODER_FILE,
                "session_options": {
                    "log_id": "qcompiler",
                    "provider_options": [],
                    "session.qdq_matmulnbits_accuracy_level": str(accuracy_level),
                },
                "head_size": facts.head_dim,
                "hidden_size": facts.hidden,
                "num_attention_heads": facts.heads,
                "num_key_value_heads": facts.kv_heads,
                "num_hidden_layers": facts.layers,
                "inputs": io_names(inputs, INPUTS, facts.layers),
                "outputs": io_names(outputs, OUTPUTS, facts.layers),
            },
        },
        "search": {**SEARCH, "max_length": context, "past_present_share_buffer": shares_buffer(decoder)},
    }

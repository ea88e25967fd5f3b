"""A ``.gguf`` file's metadata as the transformers config it restates, for reading the file as a
compile SOURCE (``source.py``): which GGUF key fills which config key, per architecture, and what
the architecture's llama.cpp graph assumes without storing it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from qcompiler.backends.gguf.archs import Arch, head_size
from qcompiler.backends.gguf.ggml_types import GGMLType

ConfigKey = tuple[str, str, bool]
"""(GGUF key, transformers config key, required)."""


def renamed(keys: tuple[ConfigKey, ...], arch: str) -> tuple[ConfigKey, ...]:
    """llama's keys under another architecture's prefix."""
    return tuple((k.replace("llama.", f"{arch}.", 1), hf, req) for k, hf, req in keys)


LLAMA_CONFIG: tuple[ConfigKey, ...] = (
    ("llama.context_length", "max_position_embeddings", True),
    ("llama.embedding_length", "hidden_size", True),
    ("llama.block_count", "num_hidden_layers", True),
    ("llama.feed_forward_length", "intermediate_size", True),
    ("llama.attention.head_count", "num_attention_heads", True),
    ("llama.attention.head_count_kv", "num_key_value_heads", False),
    ("llama.attention.layer_norm_rms_epsilon", "rms_norm_eps", True),
    ("llama.rope.freq_base", "rope_theta", False),
    ("llama.rope.dimension_count", "head_dim", False),
    ("tokenizer.ggml.bos_token_id", "bos_token_id", False),
    ("tokenizer.ggml.eos_token_id", "eos_token_id", False),
    ("tokenizer.ggml.padding_token_id", "pad_token_id", False),
)
BERT_CONFIG: tuple[ConfigKey, ...] = (
    ("bert.context_length", "max_position_embeddings", True),
    ("bert.embedding_length", "hidden_size", True),
    ("bert.block_count", "num_hidden_layers", True),
    ("bert.feed_forward_length", "intermediate_size", True),
    ("bert.attention.head_count", "num_attention_heads", True),
    ("bert.attention.layer_norm_epsilon", "layer_norm_eps", True),
    ("tokenizer.ggml.padding_token_id", "pad_token_id", False),
)
"""GGUF metadata -> transformers config, for reading a ``.gguf`` as a SOURCE (``source.py``)."""
HALF_DTYPES = {GGMLType.F16: "float16", GGMLType.BF16: "bfloat16"}
"""A float ggml type -> the config ``dtype`` of a file whose 2-D float tensors (weights) all have it."""
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
UNSUPPORTED_KEYS = {
    "llama.rope.scaling.type": ("none",),
    "bert.attention.causal": (False,),
}
"""Keys whose other values change the model in ways the imported transformers config cannot say."""
CONFIG_KEYS = {
    "llama": LLAMA_CONFIG,
    "qwen2": renamed(LLAMA_CONFIG, "qwen2"),
    "qwen3": (*renamed(LLAMA_CONFIG, "qwen3"), ("qwen3.attention.key_length", "head_dim", False)),
    "gemma": (*renamed(LLAMA_CONFIG, "gemma"), ("gemma.attention.key_length", "head_dim", True)),
    "phi3": (
        *(k for k in renamed(LLAMA_CONFIG, "phi3") if k[1] != "head_dim"),
        ("phi3.rope.dimension_count", "rotary_dims", False),
        ("phi3.rope.scaling.original_context_length", "original_max_position_embeddings", False),
        ("phi3.attention.sliding_window", "sliding_window", False),
    ),
    "bert": BERT_CONFIG,
}
FIXED_CONFIG: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu"},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu"},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_act": "silu"},
    "gemma": {
        "model_type": "gemma",
        "architectures": ["GemmaForCausalLM"],
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
    "phi3": {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_act": "silu"},
    "bert": {"model_type": "bert", "architectures": ["BertModel"], "hidden_act": "gelu"},
}
"""What the GGUF does not store but llama.cpp's graph for the architecture assumes."""


def source_config(arch: Arch, f: Any) -> dict[str, Any]:
    """The transformers config of a GGUF file (a ``reader.GGUFFile``) of architecture ``arch``."""
    from qcompiler.backends.gguf.reader import GGUFError

    def fail(key: str, message: str, expected: str, found: object) -> GGUFError:
        return GGUFError(message, file=str(f.path), where=key, field="value", expected=expected, found=str(found))

    if arch.name not in CONFIG_KEYS:
        raise GGUFError(
            "architecture not importable as a SOURCE yet", file=str(f.path), where="general.architecture",
            field="value", expected=" or ".join(CONFIG_KEYS), found=arch.name,
        )  # fmt: skip
    if "rope_freqs.weight" in f.tensors:  # a transformers config states llama3's parameters, not the factors
        raise GGUFError(
            "RoPE frequency factors (Llama 3's scaled RoPE) are not importable as a SOURCE yet",
            file=str(f.path), where="rope_freqs.weight", field="tensor", expected="no rope_freqs", found="present",
        )  # fmt: skip
    config: dict[str, Any] = dict(FIXED_CONFIG[arch.name])
    for key, hf, required in CONFIG_KEYS[arch.name]:
        entry = f.metadata.get(key)
        if entry is None:
            if required:
                raise fail(key, "required key missing", "present", "absent")
            continue
        vtype, value = entry
        if vtype == 6:  # FLOAT32: the shortest decimal that is the same float32 (1e-05, not 9.99999974e-06)
            config[hf] = float(str(np.float32(value)))  # pyright: ignore[reportArgumentType]
        elif vtype in (0, 1, 2, 3, 4, 5, 10, 11) and isinstance(value, int):
            config[hf] = int(value)
        else:
            raise fail(key, "wrong value type", "an integer or FLOAT32", f"value type {vtype}")
    for key, allowed in UNSUPPORTED_KEYS.items():
        entry = f.metadata.get(key)
        if entry is not None and entry[1] not in allowed:
            raise fail(key, "not supported when importing", " or ".join(map(str, allowed)), entry[1])
    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFError("missing", file=str(f.path), where="token_embd.weight", field="tensor")
    config["vocab_size"] = int(embd.shape[0])
    floats = {t.type_id for t in f.tensors.values() if len(t.shape) == 2 and t.type_id in FLOAT_TYPES}
    if len(floats) == 1 and GGMLType(next(iter(floats))) in HALF_DTYPES:  # the weights' dtype, as config.json says
        config["dtype"] = HALF_DTYPES[GGMLType(next(iter(floats)))]
    if "rope_theta" in config:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    if arch.name == "phi3":
        phi3_config(config, fail)
    if arch.name != "bert":
        config.setdefault("tie_word_embeddings", "output.weight" not in f.tensors)
        config["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
    else:
        types = f.tensors.get("token_types.weight")
        config["type_vocab_size"] = int(types.shape[0]) if types is not None else 2
    return config


def phi3_config(config: dict[str, Any], fail: Callable[[str, str, str, object], Exception]) -> None:
    """phi3's keys as transformers' Phi3Config says them: a sliding window of 0 is none, no padding token
    unless the file names one (Phi3Config's default, 32000, is outside a smaller vocabulary), and the
    rotated width is a ``partial_rotary_factor`` of the head (kept only where transformers gets the same
    width)."""
    config.setdefault("pad_token_id", None)
    if config.get("sliding_window") == 0:
        config["sliding_window"] = None
    rotary, head = config.pop("rotary_dims", None), head_size(config)
    if rotary is None or rotary == head:
        return
    factor = rotary / head
    if int(head * factor) != rotary:
        raise fail("phi3.rope.dimension_count", "no partial_rotary_factor gives it", f"a width of {head}", rotary)
    config.setdefault("rope_parameters", {"rope_type": "default"})["partial_rotary_factor"] = factor

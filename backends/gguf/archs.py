"""What llama.cpp expects of each architecture: tensor names, metadata keys with their exact types,
the Q/K row permutation, and which tensors must stay F32. Format knowledge as tables.

| HF (transformers) | GGUF |
|---|---|
| ``model.embed_tokens.weight``, ``embeddings.word_embeddings.weight`` | ``token_embd.weight`` |
| ``model.layers.N.self_attn.q_proj.weight`` | ``blk.N.attn_q.weight`` |
| ``encoder.layer.N.attention.self.query.weight`` | ``blk.N.attn_q.weight`` |
| ... (``LLAMA_NAMES`` and ``BERT_NAMES`` below, checked against gguf-py's name maps in the tests) | |

llama uses ggml's "normal" RoPE on adjacent pairs while transformers rotates halves, so ``q_proj``
and ``k_proj`` rows are permuted (``qk_row_permutation``): a pure permutation of rows, applied to
codes and per-row qparams alike, never a requantization.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from qcompiler.backends.gguf.writer import KV

Rule = tuple[str, str]

LLAMA_NAMES: tuple[Rule, ...] = (
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "blk.{0}.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", "blk.{0}.attn_q.{1}"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", "blk.{0}.attn_k.{1}"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", "blk.{0}.attn_v.{1}"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", "blk.{0}.attn_output.{1}"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "blk.{0}.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "blk.{0}.ffn_gate.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "blk.{0}.ffn_up.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "blk.{0}.ffn_down.weight"),
)
QWEN3_NAMES: tuple[Rule, ...] = (
    *LLAMA_NAMES,
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", "blk.{0}.attn_q_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", "blk.{0}.attn_k_norm.weight"),
)
"""Qwen3: llama's names plus the per-head RMS norms of q and k."""
PHI3_NAMES: tuple[Rule, ...] = (
    *(r for r in LLAMA_NAMES if "_proj" not in r[0]),
    (r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.weight", "blk.{0}.attn_qkv.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "blk.{0}.attn_output.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight", "blk.{0}.ffn_up.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "blk.{0}.ffn_down.weight"),
)
"""Phi-3 / Phi-4: q, k and v are one fused ``qkv_proj`` (rows q, then k, then v) and gate and up one
``gate_up_proj`` (rows gate, then up), each written as one tensor: ``attn_qkv``, and ``ffn_up``, which
llama.cpp's phi3 graph splits in halves for its SwiGLU (silu of the first half times the second)."""
BERT_NAMES: tuple[Rule, ...] = (
    (r"embeddings\.word_embeddings\.weight", "token_embd.weight"),
    (r"embeddings\.position_embeddings\.weight", "position_embd.weight"),
    (r"embeddings\.token_type_embeddings\.weight", "token_types.weight"),
    (r"embeddings\.LayerNorm\.(weight|bias)", "token_embd_norm.{0}"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.query\.(weight|bias)", "blk.{0}.attn_q.{1}"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.key\.(weight|bias)", "blk.{0}.attn_k.{1}"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.value\.(weight|bias)", "blk.{0}.attn_v.{1}"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)", "blk.{0}.attn_output.{1}"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(weight|bias)", "blk.{0}.attn_output_norm.{1}"),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)", "blk.{0}.ffn_up.{1}"),
    (r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)", "blk.{0}.ffn_down.{1}"),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.(weight|bias)", "blk.{0}.layer_output_norm.{1}"),
)
BERT_DROPPED = (r"pooler\..*", r"embeddings\.position_ids", r"embeddings\.token_type_ids")
"""Checkpoint tensors llama.cpp's BERT graph does not read (and would refuse as unconsumed)."""


def rope_theta(cfg: dict[str, Any]) -> float:
    return float(rope_parameter(cfg, "rope_theta", 10000.0))


def rope_parameter(cfg: dict[str, Any], key: str, default: Any) -> Any:
    """``key`` of config.json's ``rope_parameters`` (transformers 5), else of its top level (older files)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and key in params:
        return params[key]  # pyright: ignore[reportUnknownVariableType]
    return cfg.get(key, default)


def head_size(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


def rotary_dims(cfg: dict[str, Any]) -> int:
    """The rotated width of each head: all of it, or ``partial_rotary_factor`` of it (Phi-4-mini's 0.75),
    as transformers computes it (``int(head_dim * factor)``)."""
    return int(head_size(cfg) * float(rope_parameter(cfg, "partial_rotary_factor", 1.0)))


def decoder_metadata(arch: str, cfg: dict[str, Any], files: Mapping[str, bytes]) -> list[KV]:
    """The hyperparameters llama.cpp reads for a llama-like decoder ``arch`` (llama, qwen2, qwen3, phi3).
    Qwen3's head size is its own (``head_dim``, not hidden / heads): it states key and value lengths.
    phi3 also states the original context (``rope.scaling.original_context_length``) and its sliding
    window (0 for none), as llama.cpp's converter writes them."""
    heads = int(cfg["num_attention_heads"])
    head_dim = head_size(cfg)
    kvs = [
        KV.u32(f"{arch}.context_length", int(cfg["max_position_embeddings"])),
        KV.u32(f"{arch}.embedding_length", int(cfg["hidden_size"])),
        KV.u32(f"{arch}.block_count", int(cfg["num_hidden_layers"])),
        KV.u32(f"{arch}.feed_forward_length", int(cfg["intermediate_size"])),
        KV.u32(f"{arch}.attention.head_count", heads),
        KV.u32(f"{arch}.attention.head_count_kv", int(cfg.get("num_key_value_heads") or heads)),
        KV.f32(f"{arch}.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"])),
        KV.f32(f"{arch}.rope.freq_base", rope_theta(cfg)),
        KV.u32(f"{arch}.rope.dimension_count", rotary_dims(cfg)),
        KV.u32(f"{arch}.vocab_size", int(cfg["vocab_size"])),
    ]
    if arch == "qwen3":
        kvs += [KV.u32(f"{arch}.attention.key_length", head_dim), KV.u32(f"{arch}.attention.value_length", head_dim)]
    if arch == "phi3":
        original = rope_parameter(cfg, "original_max_position_embeddings", cfg["max_position_embeddings"])
        kvs += [
            KV.u32(f"{arch}.rope.scaling.original_context_length", int(original)),
            KV.u32(f"{arch}.attention.sliding_window", int(cfg.get("sliding_window") or 0)),
        ]
    return kvs


def llama_metadata(cfg: dict[str, Any], files: Mapping[str, bytes]) -> list[KV]:
    return decoder_metadata("llama", cfg, files)


POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3}
POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
"""sentence-transformers' ``1_Pooling/config.json`` flags -> llama.cpp pooling."""


def pooling_of(files: Mapping[str, bytes]) -> str:
    """The sentence-transformers pooling of a model directory (``none`` without one)."""
    raw = files.get("1_Pooling/config.json")
    try:
        cfg = json.loads(raw) if raw else {}
    except ValueError:
        return "none"
    return next((mode for key, mode in POOLING_MODES.items() if isinstance(cfg, dict) and cfg.get(key)), "none")


def bert_metadata(cfg: dict[str, Any], files: Mapping[str, bytes]) -> list[KV]:
    pooling = pooling_of(files)
    return [
        KV.u32("bert.context_length", int(cfg["max_position_embeddings"])),
        KV.u32("bert.embedding_length", int(cfg["hidden_size"])),
        KV.u32("bert.block_count", int(cfg["num_hidden_layers"])),
        KV.u32("bert.feed_forward_length", int(cfg["intermediate_size"])),
        KV.u32("bert.attention.head_count", int(cfg["num_attention_heads"])),
        KV.f32("bert.attention.layer_norm_epsilon", float(cfg["layer_norm_eps"])),
        KV.u32("bert.pooling_type", POOLING[pooling]),
        KV.boolean("bert.attention.causal", False),
    ]


def qk_row_permutation(rows: int, heads: int) -> np.ndarray:
    """Row order llama.cpp wants for q_proj (heads = attention heads) or k_proj (KV heads):
    ``W[perm]`` equals ``W.reshape(h, 2, rows/h/2, -1).swapaxes(1, 2).reshape(rows, -1)``."""
    idx = np.arange(rows).reshape(heads, 2, rows // heads // 2)
    return np.ascontiguousarray(idx.swapaxes(1, 2).reshape(rows))


@dataclass(frozen=True)
class Arch:
    """One architecture: GGUF name, HF classes it covers, name rules, metadata builder, row permutations."""

    name: str
    hf_classes: tuple[str, ...]
    names: tuple[Rule, ...]
    dropped: tuple[str, ...]
    metadata: Callable[[dict[str, Any], Mapping[str, bytes]], list[KV]]

    def gguf_name(self, hf: str) -> str | None:
        """The GGUF name of an HF tensor, or ``None`` when llama.cpp does not read it."""
        for pattern, template in self.names:
            m = re.fullmatch(pattern, hf)
            if m is not None:
                return template.format(*m.groups())
        return None

    def is_dropped(self, hf: str) -> bool:
        return any(re.fullmatch(p, hf) for p in self.dropped)

    def row_permutation(self, hf: str, cfg: dict[str, Any], rows: int) -> np.ndarray | None:
        if self.name != "llama":
            return None
        if re.fullmatch(r"model\.layers\.\d+\.self_attn\.q_proj\.(weight|bias)", hf):
            return qk_row_permutation(rows, int(cfg["num_attention_heads"]))
        if re.fullmatch(r"model\.layers\.\d+\.self_attn\.k_proj\.(weight|bias)", hf):
            heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
            return qk_row_permutation(rows, heads)
        return None


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
UNSUPPORTED_KEYS = {
    "llama.rope.scaling.type": ("none",),
    "bert.attention.causal": (False,),
}
"""Keys whose other values change the model in ways the imported transformers config cannot say."""
CONFIG_KEYS = {
    "llama": LLAMA_CONFIG,
    "qwen2": renamed(LLAMA_CONFIG, "qwen2"),
    "qwen3": (*renamed(LLAMA_CONFIG, "qwen3"), ("qwen3.attention.key_length", "head_dim", False)),
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
    "phi3": {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_act": "silu"},
    "bert": {"model_type": "bert", "architectures": ["BertModel"], "hidden_act": "gelu"},
}
"""What the GGUF does not store but llama.cpp's graph for the architecture assumes."""


ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", ("LlamaForCausalLM", "MistralForCausalLM"), LLAMA_NAMES, (), llama_metadata),
    "qwen2": Arch("qwen2", ("Qwen2ForCausalLM",), LLAMA_NAMES, (), functools.partial(decoder_metadata, "qwen2")),
    "qwen3": Arch("qwen3", ("Qwen3ForCausalLM",), QWEN3_NAMES, (), functools.partial(decoder_metadata, "qwen3")),
    "phi3": Arch("phi3", ("Phi3ForCausalLM",), PHI3_NAMES, (), functools.partial(decoder_metadata, "phi3")),
    "bert": Arch("bert", ("BertModel",), BERT_NAMES, BERT_DROPPED, bert_metadata),
}
"""llama.cpp's architectures by GGUF name. Mistral is llama's graph (as llama.cpp's converter writes
it); qwen2, qwen3 and phi3 rotate halves as transformers does (llama.cpp's NEOX RoPE), so only
llama's q/k rows are permuted. Phi-4 is phi3 too (``Phi3ForCausalLM``)."""
ROPE_FACTORS = {"phi3": "rope_factors_long and rope_factors_short tensors"}
"""What llama.cpp needs for RoPE scaling, by architecture (else a ``rope_freqs`` tensor)."""


def arch_for(cfg: dict[str, Any]) -> Arch | None:
    archs = cfg.get("architectures") or []
    cls = archs[0] if isinstance(archs, list) and archs else ""
    return next((a for a in ARCHS.values() if cls in a.hf_classes), None)


def refusal(cfg: dict[str, Any]) -> str:
    """Why the gguf target cannot write a model of transformers config ``cfg`` ("" when it can):
    an architecture llama.cpp has no table for here, RoPE scaling (Llama 3.1's ``llama3``, YaRN, Phi-3's
    ``longrope``...), which needs factor tensors or keys this target does not write yet, or a phi3
    ``head_dim`` other than hidden / heads (llama.cpp's phi3 graph cuts qkv at ``hidden_size``)."""
    arch = arch_for(cfg)
    if arch is None:
        classes = ", ".join(c for a in ARCHS.values() for c in a.hf_classes)
        return (
            f"target gguf writes llama.cpp models: the source must be a transformers {classes} "
            f"(found {cfg.get('architectures') or 'no transformers config'})"
        )
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = cfg.get(field) or {}
    kind = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if kind not in ("default", None):
        return (
            f"target gguf: RoPE scaling '{kind}' (config.json {field}) is not written yet "
            f"(llama.cpp needs {ROPE_FACTORS.get(arch.name, 'rope_freqs factors')} for it)"
        )
    hidden, heads, head_dim = cfg.get("hidden_size"), cfg.get("num_attention_heads"), cfg.get("head_dim")
    if arch.name == "phi3" and isinstance(head_dim, int) and isinstance(heads, int) and head_dim * heads != hidden:
        return (
            f"target gguf: config.json head_dim {head_dim} is not hidden_size / num_attention_heads "
            f"({hidden} / {heads}): llama.cpp's phi3 graph cuts qkv at hidden_size"
        )
    return ""


def source_config(arch: Arch, f: Any) -> dict[str, Any]:
    """The transformers config of a GGUF file (a ``reader.GGUFFile``) of architecture ``arch``."""
    from qcompiler.backends.gguf.reader import GGUFError

    def fail(key: str, message: str, expected: str, found: object) -> GGUFError:
        return GGUFError(message, file=str(f.path), where=key, field="value", expected=expected, found=str(found))

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
    if "rope_theta" in config:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    if arch.name == "phi3":
        phi3_config(config, fail)
    if arch.name != "bert":
        config["tie_word_embeddings"] = "output.weight" not in f.tensors
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

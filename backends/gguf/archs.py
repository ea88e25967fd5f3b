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

from qcompiler.backends.gguf.archs_moe import MIXTRAL_NAMES, QWEN_MOE_NAMES, expert_metadata, moe_refusal
from qcompiler.backends.gguf.gemma_graphs import gemma2_refusal, gemma3_refusal
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
GEMMA_NAMES: tuple[Rule, ...] = tuple(r for r in LLAMA_NAMES if not r[0].startswith("lm_head"))
"""Gemma: llama's names; the head is always the token embedding (llama.cpp has no ``output`` for it)."""
GEMMA3_NAMES: tuple[Rule, ...] = (
    *(r for r in GEMMA_NAMES if "post_attention_layernorm" not in r[0]),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", "blk.{0}.attn_q_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", "blk.{0}.attn_k_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "blk.{0}.post_attention_norm.weight"),
    (r"model\.layers\.(\d+)\.pre_feedforward_layernorm\.weight", "blk.{0}.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_feedforward_layernorm\.weight", "blk.{0}.post_ffw_norm.weight"),
)
"""Gemma3: q/k norms and a norm after attention and around the MLP (``post_attention_layernorm`` is
llama's ``ffn_norm`` but Gemma3's ``post_attention_norm``)."""
GEMMA2_NAMES: tuple[Rule, ...] = tuple(
    r for r in GEMMA3_NAMES if not r[1].startswith(("blk.{0}.attn_q_norm", "blk.{0}.attn_k_norm"))
)
"""Gemma2: Gemma3's names without the q/k norms (the same four norms a layer)."""
GEMMA_SHIFTED = (
    r"model\.norm\.weight",
    r"model\.layers\.\d+\.\w+layernorm\.weight",
    r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight",
)
"""Gemma's RMS norms scale by ``1 + w`` (in float32); llama.cpp's gemma graphs scale by the tensor, so
the GGUF holds ``1 + w`` (llama.cpp's converter adds 1 to every ``*norm.weight``)."""
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
GPT2_NAMES: tuple[Rule, ...] = (
    (r"transformer\.wte\.weight", "token_embd.weight"),
    (r"transformer\.wpe\.weight", "position_embd.weight"),
    (r"transformer\.ln_f\.(weight|bias)", "output_norm.{0}"),
    (r"lm_head\.weight", "output.weight"),
    (r"transformer\.h\.(\d+)\.ln_1\.(weight|bias)", "blk.{0}.attn_norm.{1}"),
    (r"transformer\.h\.(\d+)\.attn\.c_attn\.(weight|bias)", "blk.{0}.attn_qkv.{1}"),
    (r"transformer\.h\.(\d+)\.attn\.c_proj\.(weight|bias)", "blk.{0}.attn_output.{1}"),
    (r"transformer\.h\.(\d+)\.ln_2\.(weight|bias)", "blk.{0}.ffn_norm.{1}"),
    (r"transformer\.h\.(\d+)\.mlp\.c_fc\.(weight|bias)", "blk.{0}.ffn_up.{1}"),
    (r"transformer\.h\.(\d+)\.mlp\.c_proj\.(weight|bias)", "blk.{0}.ffn_down.{1}"),
)
"""GPT-2: the fused ``c_attn`` stays one ``attn_qkv`` (llama.cpp splits q, k, v itself). Its ``Conv1D``
weights are ``[K, N]`` in the checkpoint; ggml wants ``[N, K]`` rows (``plan.transposed_dense``)."""
BERT_DROPPED = (r"pooler\..*", r"embeddings\.position_ids", r"embeddings\.token_type_ids")
"""Checkpoint tensors llama.cpp's BERT graph does not read (and would refuse as unconsumed)."""


def rope_theta(cfg: dict[str, Any]) -> float:
    return float(rope_parameter(cfg, "rope_theta", 10000.0))


def rope_type(cfg: dict[str, Any]) -> str:
    """config.json's RoPE type (``rope_parameters``, or an older file's ``rope_scaling``): ``default`` when unscaled."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
    return str(kind or "default")  # pyright: ignore[reportUnknownArgumentType]


def rope_parameter(cfg: dict[str, Any], key: str, default: Any) -> Any:
    """``key`` of config.json's ``rope_parameters`` (transformers 5), else of its top level (older files)."""
    params = cfg.get("rope_parameters")
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # Gemma3: the full layers' (the sliding ones are fixed, GEMMA3_LOCAL)
    if isinstance(params, dict) and key in params:
        return params[key]  # pyright: ignore[reportUnknownVariableType]
    return cfg.get(key, default)


def head_size(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


def rotary_dims(cfg: dict[str, Any]) -> int:
    """The rotated width of each head: all of it, or ``partial_rotary_factor`` of it (Phi-4-mini's 0.75),
    as transformers computes it (``int(head_dim * factor)``)."""
    return int(head_size(cfg) * float(rope_parameter(cfg, "partial_rotary_factor", 1.0)))


OWN_HEAD_DIM = ("qwen3", "qwen3moe", "gemma", "gemma2", "gemma3")
"""Architectures whose head size is stated (``key_length``/``value_length``), not hidden / heads."""


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
    if arch in OWN_HEAD_DIM:
        kvs += [KV.u32(f"{arch}.attention.key_length", head_dim), KV.u32(f"{arch}.attention.value_length", head_dim)]
    if arch == "phi3":
        original = rope_parameter(cfg, "original_max_position_embeddings", cfg["max_position_embeddings"])
        kvs += [
            KV.u32(f"{arch}.rope.scaling.original_context_length", int(original)),
            KV.u32(f"{arch}.attention.sliding_window", int(cfg.get("sliding_window") or 0)),
        ]
    return kvs


def gemma3_metadata(cfg: dict[str, Any], files: Mapping[str, bytes]) -> list[KV]:
    kvs = decoder_metadata("gemma3", cfg, files)
    kvs.append(KV.u32("gemma3.attention.sliding_window", int(cfg.get("sliding_window") or 0)))
    if cfg.get("final_logit_softcapping"):
        kvs.append(KV.f32("gemma3.final_logit_softcapping", float(cfg["final_logit_softcapping"])))
    return kvs


def gemma2_metadata(cfg: dict[str, Any], files: Mapping[str, bytes]) -> list[KV]:
    """gemma2: its window and both soft caps, as llama.cpp's converter writes them (its graph caps
    attention scores and logits always: ``gemma_graphs.gemma2_refusal`` refuses a config without them)."""
    return [
        *decoder_metadata("gemma2", cfg, files),
        KV.u32("gemma2.attention.sliding_window", int(cfg["sliding_window"])),
        KV.f32("gemma2.attn_logit_softcapping", float(cfg["attn_logit_softcapping"])),
        KV.f32("gemma2.final_logit_softcapping", float(cfg["final_logit_softcapping"])),
    ]


def gpt2_metadata(cfg: dict[str, Any], files: Mapping[str, bytes]) -> list[KV]:
    """What llama.cpp's converter writes for ``GPT2LMHeadModel`` (its feed-forward width ``n_inner``,
    4 x ``n_embd`` when unset), and ``vocab_size`` for a model without tokenizer files."""
    hidden = int(cfg["n_embd"])
    return [
        KV.u32("gpt2.context_length", int(cfg["n_positions"])),
        KV.u32("gpt2.embedding_length", hidden),
        KV.u32("gpt2.block_count", int(cfg["n_layer"])),
        KV.u32("gpt2.feed_forward_length", int(cfg.get("n_inner") or 4 * hidden)),
        KV.u32("gpt2.attention.head_count", int(cfg["n_head"])),
        KV.f32("gpt2.attention.layer_norm_epsilon", float(cfg["layer_norm_epsilon"])),
        KV.u32("gpt2.vocab_size", int(cfg["vocab_size"])),
    ]


def moe_metadata(arch: str, cfg: dict[str, Any], files: Mapping[str, bytes]) -> list[KV]:
    """A decoder's keys and its experts' (``archs_moe.expert_metadata``): Mixtral on llama, qwen2moe, qwen3moe."""
    return decoder_metadata(arch, cfg, files) + expert_metadata(arch, cfg)


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
    shifted: tuple[str, ...] = ()
    """HF tensors the GGUF holds as ``1 + w`` (float32): Gemma's norms."""
    windowed: bool = False
    """llama.cpp's graph for it has sliding-window attention (``{arch}.attention.sliding_window``)."""
    rope_factors: tuple[str, ...] = ()
    """transformers rope types written as llama.cpp's per-frequency ``rope_freqs`` (``rope_freqs.py``)."""

    def gguf_name(self, hf: str) -> str | None:
        """The GGUF name of an HF tensor, or ``None`` when llama.cpp does not read it."""
        for pattern, template in self.names:
            m = re.fullmatch(pattern, hf)
            if m is not None:
                return template.format(*m.groups())
        return None

    def is_shifted(self, hf: str) -> bool:
        return any(re.fullmatch(p, hf) for p in self.shifted)

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


ARCHS: dict[str, Arch] = {
    "llama": Arch(
        "llama",
        ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"),
        LLAMA_NAMES + MIXTRAL_NAMES,
        (),
        functools.partial(moe_metadata, "llama"),
        rope_factors=("llama3",),
    ),
    "qwen2": Arch("qwen2", ("Qwen2ForCausalLM",), LLAMA_NAMES, (), functools.partial(decoder_metadata, "qwen2")),
    "qwen3": Arch("qwen3", ("Qwen3ForCausalLM",), QWEN3_NAMES, (), functools.partial(decoder_metadata, "qwen3")),
    "qwen2moe": Arch(
        "qwen2moe",
        ("Qwen2MoeForCausalLM",),
        LLAMA_NAMES + QWEN_MOE_NAMES,
        (),
        functools.partial(moe_metadata, "qwen2moe"),
    ),
    "qwen3moe": Arch(
        "qwen3moe",
        ("Qwen3MoeForCausalLM",),
        QWEN3_NAMES + QWEN_MOE_NAMES,
        (),
        functools.partial(moe_metadata, "qwen3moe"),
    ),
    "gemma": Arch(
        "gemma", ("GemmaForCausalLM",), GEMMA_NAMES, (), functools.partial(decoder_metadata, "gemma"), GEMMA_SHIFTED
    ),
    "gemma2": Arch("gemma2", ("Gemma2ForCausalLM",), GEMMA2_NAMES, (), gemma2_metadata, GEMMA_SHIFTED, True),
    "gemma3": Arch("gemma3", ("Gemma3ForCausalLM",), GEMMA3_NAMES, (), gemma3_metadata, GEMMA_SHIFTED, True),
    "phi3": Arch("phi3", ("Phi3ForCausalLM",), PHI3_NAMES, (), functools.partial(decoder_metadata, "phi3")),
    "bert": Arch("bert", ("BertModel",), BERT_NAMES, BERT_DROPPED, bert_metadata),
    "gpt2": Arch("gpt2", ("GPT2LMHeadModel",), GPT2_NAMES, (), gpt2_metadata),
}
"""llama.cpp's architectures by GGUF name. Mistral and Mixtral are llama's graph (as llama.cpp's
converter writes them; Mixtral's experts: ``archs_moe.py``, as Qwen2-MoE's and Qwen3-MoE's on qwen2moe and
qwen3moe); qwen2, qwen3 (and their MoE graphs) and phi3 rotate halves as
transformers does (llama.cpp's NEOX RoPE), so only llama's q/k rows are permuted. Phi-4 is phi3 too
(``Phi3ForCausalLM``)."""
OWN_REFUSALS: dict[str, Callable[[dict[str, Any]], str]] = {"gemma2": gemma2_refusal, "gemma3": gemma3_refusal}
"""Architectures whose llama.cpp graph fixes what a config may say (``gemma_graphs.py``): their own
checks replace the RoPE and head checks below."""
ROPE_FACTORS = {"phi3": "rope_factors_long and rope_factors_short tensors"}
"""What llama.cpp needs for RoPE scaling, by architecture (else its ``rope.scaling.*`` keys)."""


def arch_for(cfg: dict[str, Any]) -> Arch | None:
    archs = cfg.get("architectures") or []
    cls = archs[0] if isinstance(archs, list) and archs else ""
    return next((a for a in ARCHS.values() if cls in a.hf_classes), None)


def refusal(cfg: dict[str, Any]) -> str:
    """Why the gguf target cannot write a model of transformers config ``cfg`` ("" when it can): an
    architecture llama.cpp has no table for here, a sliding window its graph lacks, RoPE scaling other
    than what ``Arch.rope_factors`` writes (Llama 3's ``llama3`` on llama: ``rope_freqs.py``), such as
    YaRN or Phi-3's ``longrope``, which need factor tensors or keys this target does not write yet, or
    a phi3 ``head_dim`` other than hidden / heads (llama.cpp's phi3 graph cuts qkv at ``hidden_size``)."""
    arch = arch_for(cfg)
    if arch is None:
        classes = ", ".join(c for a in ARCHS.values() for c in a.hf_classes)
        return (
            f"target gguf writes llama.cpp models: the source must be a transformers {classes} "
            f"(found {cfg.get('architectures') or 'no transformers config'})"
        )
    window, context = cfg.get("sliding_window"), cfg.get("max_position_embeddings")
    windowed = isinstance(window, int) and isinstance(context, int) and 0 < window < context
    if windowed and cfg.get("use_sliding_window", True) is not False and not arch.windowed:
        return (
            f"target gguf: llama.cpp's {arch.name} graph has no sliding window, so it would attend past "
            f"config.json's sliding_window ({window} < max_position_embeddings {context}); the graph "
            "targets (safetensors, onnx-nbits, triton) keep the window"
        )
    moe = moe_refusal(arch.name, cfg)  # what an MoE graph fixes (top-k renormalisation, sparse layers ...)
    if moe:
        return moe
    own = OWN_REFUSALS.get(arch.name)
    if own is not None:
        return own(cfg)
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    kind = rope_type(cfg)
    if kind != "default" and kind not in arch.rope_factors:
        return (
            f"target gguf: RoPE scaling '{kind}' (config.json {field}) is not written yet for llama.cpp's "
            f"{arch.name} graph (it needs {ROPE_FACTORS.get(arch.name, 'its rope.scaling keys')}; written: "
            f"{', '.join(arch.rope_factors) or 'none'})"
        )
    hidden, heads, head_dim = cfg.get("hidden_size"), cfg.get("num_attention_heads"), cfg.get("head_dim")
    if arch.name == "phi3" and isinstance(head_dim, int) and isinstance(heads, int) and head_dim * heads != hidden:
        return (
            f"target gguf: config.json head_dim {head_dim} is not hidden_size / num_attention_heads "
            f"({hidden} / {heads}): llama.cpp's phi3 graph cuts qkv at hidden_size"
        )
    return ""

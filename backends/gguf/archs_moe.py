"""Mixture-of-experts tensors and keys for llama.cpp: format knowledge as tables.

llama.cpp's converter writes Mixtral as ``llama`` with ``llama.expert_count`` and
``llama.expert_used_count`` (u32), a float router ``blk.N.ffn_gate_inp.weight [E, hidden]`` and each
layer's experts stacked into one 3-D tensor per projection: ``blk.N.ffn_gate_exps.weight`` and
``ffn_up_exps`` ``[E, ff, hidden]``, ``ffn_down_exps`` ``[E, hidden, ff]`` (numpy order; expert ``e``'s
rows are the ``e``-th slab, its blocks row-major as a 2-D weight's). The IR keeps one logical ``[N, K]``
weight per expert (``quant/experts.py``); a name rule maps each to its slab, written
``blk.N.ffn_gate_exps.weight[e]`` (``STACKED``), and the writer joins the slabs in expert order. llama.cpp
reads the dense FFN (``ffn_gate``/``ffn_up``/``ffn_down``) when ``expert_count`` is absent or 0, and
the experts otherwise (``moe_layer_tensors``).

Qwen3-MoE and Qwen2-MoE are llama.cpp's ``qwen3moe`` and ``qwen2moe`` (``QWEN_MOE_NAMES``): the same
router and stacked experts, each expert's width in ``{arch}.expert_feed_forward_length``. qwen2moe
adds a shared expert (``ffn_{gate,up,down}_shexp``, width ``expert_shared_feed_forward_length``)
scaled by ``sigmoid(ffn_gate_inp_shexp . x)``: the gate ``[1, hidden]`` stays F32 as llama.cpp's
converter writes it (ggml sees it 1-D, ``llama_model_quantize`` leaves it as it is). Their graphs fix
what a config may vary (``moe_refusal``): qwen3moe always renormalises the top-k weights, qwen2moe
never does, every layer is MoE, qwen3moe has no q/k/v biases and qwen2moe needs its own ``output``.
"""

from __future__ import annotations

import re
from typing import Any

from qcompiler.backends.gguf.writer import KV

Rule = tuple[str, str]

MIXTRAL_NAMES: tuple[Rule, ...] = (
    (r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight", "blk.{0}.ffn_gate_inp.weight"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w1\.weight", "blk.{0}.ffn_gate_exps.weight[{1}]"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w3\.weight", "blk.{0}.ffn_up_exps.weight[{1}]"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w2\.weight", "blk.{0}.ffn_down_exps.weight[{1}]"),
)
"""Mixtral's router and experts (checkpoint names, as ``save_pretrained`` writes them) -> llama's."""
QWEN_MOE_NAMES: tuple[Rule, ...] = (
    (r"model\.layers\.(\d+)\.mlp\.gate\.weight", "blk.{0}.ffn_gate_inp.weight"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", "blk.{0}.ffn_{2}_exps.weight[{1}]"),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert\.(gate|up|down)_proj\.weight", "blk.{0}.ffn_{1}_shexp.weight"),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert_gate\.weight", "blk.{0}.ffn_gate_inp_shexp.weight"),
)
"""Qwen-MoE's router, experts, shared expert and its gate (checkpoint names) -> qwen2moe's/qwen3moe's."""
STACKED = re.compile(r"(.+)\[(\d+)\]")
"""A GGUF name with an expert index: the ``e``-th slab of a stacked 3-D tensor."""
EXPERT_COUNT = {
    "llama": ("num_local_experts",),
    "qwen3moe": ("num_local_experts", "num_experts"),
    "qwen2moe": ("num_experts", "num_local_experts"),
}
"""llama.cpp architecture -> the config.json fields that may give its expert count (first present)."""
EXPERT_WIDTHS = {
    "qwen3moe": (("expert_feed_forward_length", "moe_intermediate_size"),),
    "qwen2moe": (
        ("expert_feed_forward_length", "moe_intermediate_size"),
        ("expert_shared_feed_forward_length", "shared_expert_intermediate_size"),
    ),
}
"""(key, config.json field) of each expert width the converter writes (u32), by architecture."""
MOE_LAYER_TENSORS = [
    ("ffn_gate_inp.weight", True),
    ("ffn_gate_exps.weight", True),
    ("ffn_up_exps.weight", True),
    ("ffn_down_exps.weight", True),
]
"""The layer tensors llama.cpp's MoE FFN reads in place of ``ffn_gate``/``ffn_up``/``ffn_down``."""
SHARED_EXPERT = {"qwen2moe": [(f"ffn_{t}_shexp.weight", True) for t in ("gate_inp", "gate", "up", "down")]}
"""The shared expert's layer tensors, by architecture (its graph needs every one)."""
ROW_VECTORS = ("ffn_gate_inp_shexp.weight",)
"""Float ``[1, K]`` graph weights llama.cpp declares 1-D (``{n_embd}``) and ``llama_model_quantize``
writes 1-D: the GGUF holds ``[K]`` (the same bytes), read back as the graph's one row (``@values!row``).
llama.cpp's converter writes the shared-expert gate ``[1, hidden]``; both load, and the 1-D form is the
one a quantized file from llama.cpp holds."""
DENSE_FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
RENORMALISED = {"qwen3moe": True, "qwen2moe": False}
"""Whether llama.cpp's graph renormalises the top-k router weights (``norm_w`` of its ``build_moe_ffn``):
config.json's ``norm_topk_prob`` must say the same."""


def stacked(name: str) -> tuple[str, int | None]:
    """A GGUF name -> (the file's tensor name, the expert slab it names or None)."""
    m = STACKED.fullmatch(name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


def row_vector(name: str, shape: tuple[int, ...]) -> bool:
    """Whether GGUF tensor ``name`` of graph shape ``shape`` is written 1-D (``ROW_VECTORS``)."""
    return name.endswith(ROW_VECTORS) and len(shape) == 2 and shape[0] == 1


def experts_of(arch: str, cfg: dict[str, Any]) -> int:
    """The expert count config.json gives for ``arch`` (0 for a dense model)."""
    return int(next((cfg[f] for f in EXPERT_COUNT.get(arch, ()) if cfg.get(f)), 0))


def expert_metadata(arch: str, cfg: dict[str, Any]) -> list[KV]:
    """``{arch}.expert_count``, ``expert_used_count`` and the expert widths of an MoE config ([] for a
    dense one), as llama.cpp's converter writes them."""
    count = experts_of(arch, cfg)
    if not count:
        return []
    kvs = [KV.u32(f"{arch}.expert_count", count), KV.u32(f"{arch}.expert_used_count", int(cfg["num_experts_per_tok"]))]
    return kvs + [KV.u32(f"{arch}.{key}", int(cfg[field])) for key, field in EXPERT_WIDTHS.get(arch, ())]


def moe_layer_tensors(layer: list[tuple[str, bool]], arch: str = "llama") -> list[tuple[str, bool]]:
    """A dense decoder layer's tensors with the FFN replaced by the experts' (and ``arch``'s shared expert)."""
    return [t for t in layer if t[0] not in DENSE_FFN] + MOE_LAYER_TENSORS + SHARED_EXPERT.get(arch, [])


def moe_refusal(arch: str, cfg: dict[str, Any]) -> str:
    """What config.json says that llama.cpp's ``arch`` MoE graph cannot compute ("" when nothing)."""
    if arch not in RENORMALISED:
        return ""
    fixed = f"target gguf: llama.cpp's {arch} graph"
    if not experts_of(arch, cfg) or not cfg.get("num_experts_per_tok"):
        return f"{fixed} needs experts (config.json num_experts and num_experts_per_tok > 0)"
    if bool(cfg.get("norm_topk_prob", False)) != RENORMALISED[arch]:
        how = "always renormalises" if RENORMALISED[arch] else "never renormalises"
        return f"{fixed} {how} the top-k router weights (config.json norm_topk_prob is {cfg.get('norm_topk_prob')})"
    if int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers"):
        return (
            f"{fixed} has experts in every layer (config.json decoder_sparse_step "
            f"{cfg.get('decoder_sparse_step')}, mlp_only_layers {cfg.get('mlp_only_layers')})"
        )
    if arch == "qwen3moe" and cfg.get("attention_bias"):
        return f"{fixed} reads no q/k/v/o biases (config.json attention_bias is true)"
    if arch == "qwen2moe" and cfg.get("tie_word_embeddings"):
        return f"{fixed} needs its own output.weight (config.json tie_word_embeddings is true)"
    return ""

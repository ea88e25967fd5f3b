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
STACKED = re.compile(r"(.+)\[(\d+)\]")
"""A GGUF name with an expert index: the ``e``-th slab of a stacked 3-D tensor."""
EXPERT_COUNT = {"llama": "num_local_experts"}
"""llama.cpp architecture -> the config.json field that gives its expert count."""
MOE_LAYER_TENSORS = [
    ("ffn_gate_inp.weight", True),
    ("ffn_gate_exps.weight", True),
    ("ffn_up_exps.weight", True),
    ("ffn_down_exps.weight", True),
]
"""The layer tensors llama.cpp's MoE FFN reads in place of ``ffn_gate``/``ffn_up``/``ffn_down``."""
DENSE_FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def stacked(name: str) -> tuple[str, int | None]:
    """A GGUF name -> (the file's tensor name, the expert slab it names or None)."""
    m = STACKED.fullmatch(name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


def expert_metadata(arch: str, cfg: dict[str, Any]) -> list[KV]:
    """``{arch}.expert_count`` and ``{arch}.expert_used_count`` of an MoE config ([] for a dense one)."""
    field = EXPERT_COUNT.get(arch)
    if not field or not cfg.get(field):
        return []
    return [
        KV.u32(f"{arch}.expert_count", int(cfg[field])),
        KV.u32(f"{arch}.expert_used_count", int(cfg["num_experts_per_tok"])),
    ]


def moe_layer_tensors(layer: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """A dense decoder layer's tensors with the FFN replaced by the experts'."""
    return [t for t in layer if t[0] not in DENSE_FFN] + MOE_LAYER_TENSORS

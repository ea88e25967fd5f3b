"""The GGUF target's tables against llama.cpp's own, as gguf-py states them (``gguf.MODEL_TENSORS``,
``gguf.TENSOR_NAMES``, ``gguf.Keys``): every tensor the reader expects of an architecture, every
name the emit writes for an HF tensor, and every metadata key is one llama.cpp declares for that
architecture. A typo in a table would otherwise show only as llama.cpp refusing (or ignoring) a file."""

from __future__ import annotations

import re
from typing import Any

import gguf
import pytest
import torch
import transformers

from qcompiler.backends.gguf.archs import ARCHS, arch_for
from qcompiler.backends.gguf.tensor_tables import expected_tensors
from qcompiler.quant.experts import unfuse_experts


def declared(arch: str) -> set[str]:
    """llama.cpp's tensor names for ``arch``, with ``{bid}`` as in gguf-py."""
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    return {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[model_arch]}


def template(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``blk.{bid}.attn_q`` (gguf-py's form, without the suffix)."""
    return re.sub(r"^blk\.\d+\.", "blk.{bid}.", name.rsplit(".", 1)[0])


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_expected_tensor_is_one_llama_cpp_declares(arch: str) -> None:
    dense = set() if arch in ("qwen2moe", "qwen3moe") else set(expected_tensors(arch, 2))  # MoE-only graphs
    moe = set(expected_tensors(arch, 2, moe=True)) if arch in ("llama", "qwen2moe", "qwen3moe") else set()
    names = dense | moe  # Mixtral is llama's graph with experts
    unknown = sorted(n for n in names if template(n) not in declared(arch))
    assert unknown == [], unknown


def gguf_keys() -> set[str]:
    """Every key template gguf-py names (``gguf.Keys`` and its nested classes), ``{arch}`` unfilled."""
    found: set[str] = set()
    todo: list[type] = [gguf.Keys]
    while todo:
        for name, value in vars(todo.pop()).items():
            if isinstance(value, str) and not name.startswith("_"):
                found.add(value)
            elif isinstance(value, type):
                todo.append(value)
    return found


CONFIGS: dict[str, Any] = {
    "LlamaForCausalLM": transformers.LlamaConfig,
    "MixtralForCausalLM": transformers.MixtralConfig,
    "Qwen2ForCausalLM": transformers.Qwen2Config,
    "Qwen3ForCausalLM": transformers.Qwen3Config,
    "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
    "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
    "GemmaForCausalLM": transformers.GemmaConfig,
    "Gemma2ForCausalLM": transformers.Gemma2Config,
    "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
    "Phi3ForCausalLM": transformers.Phi3Config,
    "GPT2LMHeadModel": transformers.GPT2Config,
    "BertModel": transformers.BertConfig,
}
"""An architecture class -> its transformers config (defaults: the metadata builders only read values)."""


@pytest.mark.parametrize("cls", sorted(CONFIGS))
def test_every_metadata_key_is_one_gguf_py_names(cls: str) -> None:
    arch = arch_for({"architectures": [cls]})
    assert arch is not None
    cfg = {**CONFIGS[cls]().to_dict(), "architectures": [cls]}
    known = {k.replace("{arch}", arch.name) for k in gguf_keys()}
    keys = [kv.key for kv in arch.metadata(cfg, {})]
    assert f"{arch.name}.block_count" in keys
    assert sorted(k for k in keys if k not in known) == []


@pytest.mark.parametrize("cls", sorted(CONFIGS))
def test_every_weight_of_a_model_gets_a_name_llama_cpp_declares(cls: str) -> None:
    """The model built from the default config (on the meta device, 2 layers; MoE experts as their
    checkpoint names them): each tensor the emit names (``Arch.gguf_name``) is one the architecture
    declares, and every linear weight is named (none silently left out of the file)."""
    arch = arch_for({"architectures": [cls]})
    assert arch is not None
    layers: dict[str, Any] = {"n_layer" if cls == "GPT2LMHeadModel" else "num_hidden_layers": 2}
    cfg = CONFIGS[cls](**layers)
    auto = transformers.AutoModel if cls == "BertModel" else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = unfuse_experts(auto.from_config(cfg))
    named = {hf: arch.gguf_name(hf) for hf in model.state_dict()}
    written = sorted({str(g).split("[")[0] for g in named.values() if g is not None})
    assert [g for g in written if template(g) not in declared(arch.name)] == []
    linears = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    dropped = [hf for hf in linears if named.get(hf) is None and not any(re.fullmatch(p, hf) for p in arch.dropped)]
    assert dropped in ([], ["lm_head.weight"]), dropped  # a tied head is the token table

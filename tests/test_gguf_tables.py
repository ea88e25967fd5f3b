"""The GGUF target's tensor tables against llama.cpp's own, as gguf-py states them
(``gguf.MODEL_TENSORS``, ``gguf.TENSOR_NAMES``): every tensor the reader expects of an architecture,
and every name the emit writes for an HF tensor, is one llama.cpp's graph for that architecture
declares. A typo in a table would otherwise show only as llama.cpp refusing (or ignoring) a file."""

from __future__ import annotations

import re

import gguf
import pytest

from qcompiler.backends.gguf.archs import ARCHS
from qcompiler.backends.gguf.read import expected_tensors


def declared(arch: str) -> set[str]:
    """llama.cpp's tensor names for ``arch``, with ``{bid}`` as in gguf-py."""
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    return {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[model_arch]}


def template(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``blk.{bid}.attn_q`` (gguf-py's form, without the suffix)."""
    return re.sub(r"^blk\.\d+\.", "blk.{bid}.", name.rsplit(".", 1)[0])


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_expected_tensor_is_one_llama_cpp_declares(arch: str) -> None:
    names = set(expected_tensors(arch, 2)) | (set(expected_tensors(arch, 2, moe=True)) if arch == "llama" else set())
    unknown = sorted(n for n in names if template(n) not in declared(arch))
    assert unknown == [], unknown


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_name_rule_writes_a_tensor_llama_cpp_declares(arch: str) -> None:
    """Each rule's GGUF template, filled for layer 0 (``archs.Arch.names``)."""
    written = [t.format(*(["0"] * t.count("{"))) for _, t in ARCHS[arch].names]
    unknown = sorted(n for n in written if template(n.split("[")[0]) not in declared(arch))
    assert unknown == [], unknown

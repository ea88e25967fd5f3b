"""Llama 3's RoPE scaling in a GGUF: llama.cpp's ``rope_freqs.weight``.

Llama 3.1/3.2 (config.json ``rope_parameters.rope_type`` ``llama3``) divide each RoPE frequency by
its own factor: 1 for the fast ones, ``factor`` for the slow ones, a smooth blend between. llama.cpp
reads these factors from a 1-D F32 tensor, ``rope_freqs.weight`` (``n_rot / 2`` entries), and rotates
by ``base ** (-2i / n_rot) / rope_freqs[i]``.

The factors are derived from the graph, not from the config: ``base ** (-2i / n_rot)`` divided by the
``inv_freq`` table the captured model multiplies positions by, so the tensor states what the graph
computes. It is not a weight of the source; the reader binds it twice: its sha256 is in
``graph.qir``'s ``bound.gguf`` record (an edited or removed table is refused), and ``rope.freq_base``
with it must reproduce the graph's ``inv_freq`` (``facts.rope_matches``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qcompiler.backends.gguf.archs import Arch, rope_theta, rope_type
from qcompiler.backends.gguf.reader import GGUFFile
from qcompiler.ir.core import Module
from qcompiler.ir.facts import digest, model_facts

TENSOR = "rope_freqs.weight"


def rope_freqs(m: Module, arch: Arch, cfg: dict[str, Any]) -> np.ndarray | None:
    """The factors llama.cpp divides each base frequency by (float32), from ``m``'s own ``inv_freq``;
    ``None`` when the model's RoPE is not scaled this way."""
    if rope_type(cfg) not in arch.rope_factors:
        return None
    facts = model_facts(m)
    if facts.inv_freq is None or facts.rotary_dim is None:
        return None
    d = facts.rotary_dim
    exps = (np.arange(0, d, 2).astype(np.float32) / np.float32(d)).astype(np.float64)
    base = 1.0 / np.float64(rope_theta(cfg)) ** exps
    return (base / np.asarray(facts.inv_freq, dtype=np.float64)).astype("<f4")


def factors_of(f: GGUFFile) -> np.ndarray | None:
    """The file's ``rope_freqs`` (float64), or ``None``."""
    return f.array(TENSOR).astype(np.float64) if TENSOR in f.tensors else None


def factor_digests(f: GGUFFile) -> dict[str, str]:
    """``tensor rope_freqs.weight`` -> sha256 of its values, for the ``bound.gguf`` record."""
    return {f"tensor {TENSOR}": digest(f.array(TENSOR).tolist())} if TENSOR in f.tensors else {}

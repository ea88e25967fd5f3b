"""Parity evidence gathered on a reopened artifact, before it is published (kept in the manifest).

Rungs 1-3 run on the module the production reader rebuilt from the artifact's own bytes:

1. pack/unpack of every weight's codes through its layout;
2. reference reconstruction: the artifact's decode equals, bit for bit, the weights the model used
   (``effective``), or, when those are not at hand (``qcompiler opt``), the decode of the module
   that was emitted; the sha256 of every decode is recorded so ``qcompiler verify`` can re-prove
   rung 2 later from the artifact alone;
3. operator errors per quantized linear: kernel error apart from quantization error.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from qcompiler.ir.core import Module
from qcompiler.parity import decoded_weights, rung1_pack_unpack, rung2_reconstruction, rung3_operators


def decode_hashes(decodes: Mapping[str, np.ndarray]) -> dict[str, str]:
    """sha256 of each weight's reference decode (float32 little-endian bytes)."""
    return {name: hashlib.sha256(np.ascontiguousarray(w, "<f4").tobytes()).hexdigest() for name, w in decodes.items()}


def gather(
    m: Module,
    effective: Mapping[str, torch.Tensor | np.ndarray],
    float_weights: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Rungs 1-3 on ``m`` (a reopened artifact) as a JSON-able record; ``ok`` is false on any failure."""
    decodes = decoded_weights(m)
    r1 = rung1_pack_unpack(m)
    r2 = rung2_reconstruction(m, effective, decodes)
    r3 = rung3_operators(m, float_weights, decodes=decodes)
    failures = [f"rung {r.rung} {r.tensor}: {r.detail}" for r in r1 + r2 if not r.ok]
    return {
        "ok": not failures,
        "failures": failures,
        "rung1_pack_unpack": {"weights": len(r1), "passed": sum(r.ok for r in r1)},
        "rung2_reconstruction": {
            "weights": len(r2),
            "bit_exact": sum(r.ok for r in r2),
            "reference": "source effective weights" if effective else "emitted module",
            "decode_sha256": decode_hashes(decodes),
        },
        "rung3_operators": {r.tensor: {k: float(v) for k, v in r.metrics.items()} for r in r3},
    }

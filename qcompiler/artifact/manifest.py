"""The manifest: the root of reachability of an artifact, written last.

Sections: ``versions`` (container, artifact schema, quantized representation, packing layouts,
graph, tested runtimes, required kernels, each separate), ``target``, ``model`` (architecture and
revision), ``tokenizer_sha256``, ``provenance`` (source sha256, converter version and git commit,
quantization config sha256, calibration), ``topology``, ``files`` (added by the writer: size and
sha256 of every file), ``rate_ledger``, ``conversions`` and ``parity``. See docs/artifact.md.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

from qcompiler.ir.core import Module
from qcompiler.ir.types import DenseType
from qcompiler.parity import weights
from qcompiler.version import __version__

ARTIFACT_SCHEMA = 1
GRAPH_VERSION = "qir/1"


def canonical_sha256(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def git_commit() -> str:
    """The commit of the qcompiler checkout this runs from, or ``unknown`` (an installed wheel)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "generation_config.json",
    "modules.json",
    "1_Pooling/config.json",
)
"""Files carried from a model directory into the artifact byte for byte (sentence-transformers'
``modules.json`` and pooling config too: they say how a model's embeddings are pooled)."""


def files_sha256(files: dict[str, bytes]) -> str | None:
    """One sha256 over named files (name and content hash, sorted), or ``None`` when there are none."""
    return digests_sha256({name: hashlib.sha256(data).hexdigest() for name, data in files.items()})


def digests_sha256(digests: dict[str, str]) -> str | None:
    """``files_sha256`` from each file's sha256 (hex), for files hashed while they streamed."""
    if not digests:
        return None
    lines = "".join(f"{name}\0{digest}\n" for name, digest in sorted(digests.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def rate_ledger(m: Module, stored_bytes: dict[str, int], all_params: int, file_bytes: int) -> dict[str, Any]:
    """Bits per weight under each scope, stated explicitly; ``stored_bytes`` maps a weight name to the
    bytes its container tensors take (codes, qparams, shape, padding)."""
    rows: list[dict[str, Any]] = []
    for name, _, t in weights(m):
        params = int(t.shape[0]) * int(t.shape[1]) if t.rank == 2 else 0
        qbits = sum(s.dtype.itemsize * 8 * (s.numel() or 0) for _, s in t.qparams if isinstance(s, DenseType))
        xbits = sum(s.dtype.itemsize * 8 * (s.numel() or 0) for _, s in t.exceptions if isinstance(s, DenseType))
        rows.append(
            {
                "tensor": name,
                "params": params,
                "codes_bits": params * t.code.dtype.bits,
                "qparam_bits": qbits,
                "exception_bits": xbits,
                "stored_bits": stored_bytes.get(name, 0) * 8,
            }
        )
    quantized = sum(r["params"] for r in rows) or 1
    codes = sum(r["codes_bits"] for r in rows)
    qparams = sum(r["qparam_bits"] for r in rows)
    exceptions = sum(r["exception_bits"] for r in rows)
    stored = sum(r["stored_bits"] for r in rows)
    scopes = [
        ("codes only", codes, quantized),
        ("codes + qparams", codes + qparams, quantized),
        ("codes + qparams + exceptions (sparse outliers)", codes + qparams + exceptions, quantized),
        ("quantized tensors as stored (codes, qparams, shapes, padding)", stored, quantized),
        ("whole artifact (every file byte over every parameter)", file_bytes * 8, all_params or 1),
    ]
    return {
        "quantized_params": sum(r["params"] for r in rows),
        "all_params": all_params,
        "scopes": [{"scope": s, "bits": b, "per": p, "bits_per_weight": round(b / p, 6)} for s, b, p in scopes],
        "tensors": rows,
    }


def converter() -> dict[str, str]:
    return {"name": "qcompiler", "version": __version__, "git_commit": git_commit()}

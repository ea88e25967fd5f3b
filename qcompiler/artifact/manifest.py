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

import numpy as np

from qcompiler.ir.core import Module, Op
from qcompiler.ir.descriptor import part_bits, slot_bits
from qcompiler.ir.mixprec import PlanesLayout, dims, wide_count
from qcompiler.ir.types import DenseType, QuantType
from qcompiler.parity import parts, weights
from qcompiler.version import __version__

ARTIFACT_SCHEMA = 2
"""The schema compiles write (``manifest_schema.DECODE_FIELDS``: the reader reads 1 and 2)."""
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


def dense_bits(slots: tuple[tuple[str, DenseType | QuantType], ...]) -> int:
    return sum(s.dtype.itemsize * 8 * (s.numel() or 0) for _, s in slots if isinstance(s, DenseType))


def part_counts(t: QuantType, params: int) -> tuple[int, int, int]:
    """Bits of the codes, the qparams and the exceptions of one weight. A ``mixprec`` weight is counted
    from its descriptor (2 bits a code, 2 more in a 4-bit group; nested qparams with their own codes
    and qparams); every other family as the ledger always has (a code of the code type's width for
    each of the ``params`` of a rank-2 weight, dense qparam and exception slots)."""
    if t.family in DETAILS:
        return part_bits(t, "codes"), sum(slot_bits(s) for _, s in t.qparams), part_bits(t, "exceptions")
    return params * t.code.dtype.bits, dense_bits(t.qparams), dense_bits(t.exceptions)


def mixprec_details(m: Module, op: Op, t: QuantType) -> dict[str, Any]:
    """What a ``mixprec`` weight's arrays realize (docs/artifact.md, rate ledger): group counts by
    width, the outliers and their rows, qparam bytes by level, the planes' padding, the all-in rate."""
    n, k, g = dims(t)
    w4 = wide_count(t)
    b = parts(m, {"rowptr": op.attrs["rowptr"]})["rowptr"]
    per_row = np.diff(np.asarray(b, dtype=np.int64))
    scale = t.qparam("scale")
    zero = t.qparam("zero")
    assert scale is not None
    assert zero is not None
    first = slot_bits(zero) + (part_bits(scale, "codes") if isinstance(scale, QuantType) else slot_bits(scale))
    second = sum(slot_bits(s) for s in scale.slots().values()) if isinstance(scale, QuantType) else 0
    low, high = PlanesLayout.planes(t)
    planes = PlanesLayout.physical(t)[1][0]
    codes, qparams, exceptions = part_counts(t, n * k)
    return {
        "groups_w2": n * (k // g) - w4,
        "groups_w4": w4,
        "group_size": g,
        "outliers": int(per_row.sum()),
        "outlier_rows": int((per_row > 0).sum()),
        "outliers_max_per_row": int(per_row.max(initial=0)),
        "outliers_mean_per_row": round(float(per_row.mean()) if n else 0.0, 6),
        "qparam_bytes_first_level": first // 8,
        "qparam_bytes_second_level": second // 8,
        "exception_bytes": exceptions // 8,
        "planes_bytes": planes,
        "planes_padding_bytes": planes - low - high,
        "bits_per_weight": round((codes + qparams + exceptions) / (n * k), 6),
        "loaded_bytes": planes + (qparams + exceptions) // 8,
    }


DETAILS = {"mixprec": mixprec_details}
"""Families whose ledger rows follow from the descriptor (``part_bits``) and carry a ``family``
section of what their arrays realize."""


def rate_ledger(m: Module, stored_bytes: dict[str, int], all_params: int, file_bytes: int) -> dict[str, Any]:
    """Bits per weight under each scope, stated explicitly; ``stored_bytes`` maps a weight name to the
    bytes its container tensors take (codes, qparams, shape, padding)."""
    rows: list[dict[str, Any]] = []
    for name, op, t in weights(m):
        params = int(t.shape[0]) * int(t.shape[1]) if t.rank == 2 else 0
        codes, qbits, xbits = part_counts(t, params)
        rows.append(
            {
                "tensor": name,
                "params": params,
                "codes_bits": codes,
                "qparam_bits": qbits,
                "exception_bits": xbits,
                "stored_bits": stored_bytes.get(name, 0) * 8,
            }
        )
        if t.family in DETAILS:
            rows[-1][t.family] = DETAILS[t.family](m, op, t)
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

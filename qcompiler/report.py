"""What ``qcompiler inspect`` and ``qcompiler verify`` report, as JSON-able dicts (the CLI renders them).

``verify_artifact`` reopens an artifact through every reader gate, then re-runs the parity rungs
the artifact supports on its own bytes: (1) pack/unpack of every weight, (2) the reference decode
of every weight against the sha256 recorded at compile time (where the decode was proven equal to
the source model's weights), (3) operator kernel error per quantized linear.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from qcompiler.artifact.evidence import beside_the_ladder, probe_failures
from qcompiler.artifact.manifest import ARTIFACT_SCHEMA
from qcompiler.artifact.manifest_schema import DECODE_FIELDS
from qcompiler.artifact.reader import open_artifact
from qcompiler.errors import QcError
from qcompiler.ir.types import DenseType
from qcompiler.parity import weights

KERNEL_TOLERANCE = 1e-5
"""Largest relative operator error of torch's float32 linear against the float64 reference decode."""


def verify_artifact(
    path: Path | str,
    level: int = 3,
    fallback: str = "forbid",
    device: str = "cpu",
    trusted_key: Path | str | None = None,
    jobs: int = 0,
    compute: str = "auto",
) -> dict[str, Any]:
    """Gates and rungs 1-3; with ``level`` 4 or 5 also the runtime's rungs (``qcompiler.runtime.rungs``)
    on a load for ``device``. First ``signature``: with ``trusted_key`` (a public key PEM) a valid
    signature by that key is required; without, only a malformed ``manifest.sig`` fails. ``jobs``:
    threads for rungs 1-3 (0: every core; the result is the same for any count). ``compute``: the runtime's
    activation dtype for rungs 4-5 (``qcompiler.load``); the resolved one is reported as ``compute``."""
    out: dict[str, Any] = {"path": str(path), "ok": False, "gates": [], "rungs": {}, "level": level}
    if not signature_checked(out, path, trusted_key):
        return out
    try:
        opened = open_artifact(path)
    except QcError as e:
        out["error"] = str(e)
        return out
    out["gates"] = opened.gates
    m = opened.module
    parity: dict[str, Any] = (opened.manifest or {}).get("parity", {})
    # the digest field of the manifest's schema (read_manifest checked it is there)
    digest = DECODE_FIELDS[(opened.manifest or {}).get("versions", {}).get("artifact_schema", ARTIFACT_SCHEMA)]
    recorded: dict[str, str] = parity.get("rung2_reconstruction", {}).get(digest, {})
    # weight by weight: memory follows the largest weights, not the model; the probe beside it
    probe = parity.get("graph_probe")
    jobs = jobs or os.cpu_count() or 1
    rows, probe_failed = beside_the_ladder(lambda g: probe_failures(g, probe), m, None, None, jobs, digest=digest)
    r1, r3, hashes = rows.r1, rows.r3, rows.decode_digests
    r2_fail = sorted(n for n in set(hashes) | set(recorded) if hashes.get(n) != recorded.get(n))
    r3_fail = [r.tensor for r in r3 if r.metrics["rel_kernel"] > KERNEL_TOLERANCE]
    rungs: dict[str, dict[str, Any]] = {
        "1_pack_unpack": {"weights": len(r1), "failed": [r.tensor for r in r1 if not r.ok]},
        "2_reconstruction": {
            "weights": len(hashes),
            "reference": f"decode digests recorded at compile time ({digest})",
            "failed": r2_fail,
        },
        "3_operators": {
            "weights": len(r3),
            "max_rel_kernel": max((r.metrics["rel_kernel"] for r in r3), default=0.0),
            "tolerance": KERNEL_TOLERANCE,
            "failed": r3_fail,
        },
    }
    rungs["3_graph_probe"] = {"weights": len(r3), "recorded": probe is not None, "failed": probe_failed}
    if level >= 4:
        rungs.update(runtime_rungs(path, level, fallback, device, compute))
        if "compute" in rungs["4_graph_logits"]:
            out["compute"] = rungs["4_graph_logits"]["compute"]
    out["rungs"] = rungs
    failed = [f"rung {k}: {', '.join(v['failed'][:3])}" for k, v in rungs.items() if v["failed"]]
    from qcompiler.backends import get_backend

    runtime = get_backend(opened.target).runtime_report(opened)
    if runtime is not None:
        out["dispatch"] = runtime
        if not runtime.get("ok"):
            failed.append(f"dispatch: {runtime}")
    if failed:
        out["error"] = "; ".join(failed)
    out["ok"] = not failed
    return out


def signature_checked(out: dict[str, Any], path: Path | str, trusted_key: Path | str | None) -> bool:
    """Put ``verify``'s ``signature`` entry into ``out`` (``qcompiler.artifact.signing``); False, with
    ``out["error"]`` set, when the signature fails."""
    from qcompiler.artifact.signing import signature_report

    out["signature"] = signature_report(path, trusted_key)
    if not out["signature"]["ok"]:
        out["error"] = out["signature"]["error"]
    return bool(out["signature"]["ok"])


def runtime_rungs(
    path: Path | str, level: int, fallback: str, device: str = "cpu", compute: str = "auto"
) -> dict[str, dict[str, Any]]:
    """Rung 4 (graph, logits, greedy trace) and rung 5 (dispatch, resources) on the loaded artifact."""
    from qcompiler.runtime import load
    from qcompiler.runtime.rungs import rung4, rung5

    try:
        lm = load(path, device=device, fallback=fallback, compute=compute)  # type: ignore[arg-type]
    except QcError as e:
        return {"4_graph_logits": {"weights": 0, "failed": [f"load: {e}"]}}
    out = {"4_graph_logits": {"weights": len({d.weight for d in lm.decisions}), **rung4(lm)}}
    if level >= 5:
        out["5_dispatch_resources"] = {"weights": len({d.weight for d in lm.decisions}), **rung5(lm)}
    return out


def origin(records: list[dict[str, Any]], prov: dict[str, Any]) -> str:
    """Where a weight's codes come from, given its ``conversions`` records: preserved from the
    source, quantized by this compile, kept through lossless refinements, or converted (kinds, and
    the largest measured error)."""
    kinds = ", ".join(str(c.get("kind")) for c in records)
    if records and all(c.get("lossless") for c in records):
        return f"preserved ({kinds}, lossless)"
    if records:
        worst = max(float(c.get("rel_l2") or 0.0) for c in records)
        return f"converted ({kinds}, rel L2 {worst:.1e})"
    return f"quantized here ({prov['scheme']})" if prov.get("scheme") else "preserved"


def inspect_artifact(path: Path | str) -> dict[str, Any]:
    opened = open_artifact(path)
    manifest = opened.manifest or {}
    converted: dict[str, list[dict[str, Any]]] = {}
    for c in manifest.get("conversions") or []:
        if isinstance(c, dict):
            converted.setdefault(str(c.get("tensor")), []).append(c)
    raw = opened.module.attrs.get("provenance")
    prov: dict[str, Any] = raw if isinstance(raw, dict) else {}
    descriptors = []
    for name, _, t in weights(opened.module):
        qparams = {k: s.short() for k, s in t.qparams if isinstance(s, DenseType)}
        descriptors.append(
            {
                "tensor": name,
                "family": f"{t.family}/decoder-{t.decoder}",
                "codes": t.code.head(),
                "shape": [int(d) for d in t.shape],
                "group": None
                if t.group is None
                else {"axis": t.group.axis, "size": t.group.size, "tail": t.group.tail},
                "qparams": qparams,
                "layout": f"{t.pack.family}/v{t.pack.version} {t.pack.encoding}",
                "codes_origin": origin(converted.get(name, []), prov),
            }
        )
    return {
        "path": str(path),
        "target": opened.target,
        "gates": opened.gates,
        "versions": manifest.get("versions"),
        "model": manifest.get("model"),
        "tokenizer_sha256": manifest.get("tokenizer_sha256"),
        "provenance": manifest.get("provenance"),
        "topology": manifest.get("topology"),
        "files": manifest.get("files"),
        "inventory": [
            {"tensor": e.name, "file": e.file, "dtype": e.dtype, "shape": list(e.shape), "bytes": e.nbytes}
            for e in opened.entries
        ],
        "descriptors": descriptors,
        "rate_ledger": manifest.get("rate_ledger"),
        "conversions": manifest.get("conversions"),
        "parity": manifest.get("parity"),
    }

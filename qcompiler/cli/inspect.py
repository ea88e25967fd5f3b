"""qcompiler inspect PATH [--json]: what an artifact holds, after every reader gate passed: files,
tensor inventory, quantized descriptors and layouts, versions, provenance, the rate ledger (each
scope stated: codes only; codes + qparams; quantized tensors as stored; whole artifact),
conversions and the parity evidence recorded when it was compiled. With --load it also loads the
artifact with the CPU runtime and shows the startup timeline, the memory ledger and the kernels."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from qcompiler.report import inspect_artifact


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="artifact directory")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.add_argument("--tensors", action="store_true", help="also list every container tensor")
    p.add_argument(
        "--load",
        action="store_true",
        help="also load it with the runtime (fallback allowed): startup timeline, memory ledger, kernels",
    )
    p.add_argument("--device", default="cpu", help="with --load: cpu, cuda, cuda:N or interpret")


def runtime_view(path: str, device: str = "cpu") -> dict[str, Any]:
    """The startup timeline, memory ledger and selected kernels of a load (fallback allowed, reported)."""
    from qcompiler.runtime import load

    lm = load(path, device=device, fallback="allow")
    kernels: dict[str, int] = {}
    for d in lm.decisions:
        kernels[f"{d.selected} ({d.kind}, {d.phase})"] = kernels.get(f"{d.selected} ({d.kind}, {d.phase})", 0) + 1
    return {
        "timeline_s": {k: round(v, 6) for k, v in lm.timeline.items()},
        "memory_bytes": lm.memory,
        "kernels": kernels,
        "fallback_fraction": lm.fallback_fraction(),
        "loaded_bits_per_weight": round(lm.loaded_bits_per_weight(), 6),
    }


def table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, no_wrap=True)
    for r in rows:
        t.add_row(*[str(v) for v in r])
    return t


def run(args: argparse.Namespace) -> int:
    info = inspect_artifact(args.path)
    if args.load:
        info["runtime"] = runtime_view(args.path, args.device)
    if args.json:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
        return 0
    console = Console(width=max(Console().width, 200))
    model, prov = info["model"] or {}, info["provenance"] or {}
    console.print(
        f"[bold]{info['path']}[/bold]: {info['target']} artifact of {model.get('architecture')} "
        f"({model.get('revision')}); gates passed: {', '.join(info['gates'])}"
    )
    console.print(table("versions", ["what", "version"], [[k, v] for k, v in (info["versions"] or {}).items()]))
    conv = prov.get("converter", {})
    console.print(
        table(
            "provenance",
            ["what", "value"],
            [
                ["source", prov.get("source")],
                ["source sha256", prov.get("source_sha256")],
                ["converter", f"{conv.get('name')} {conv.get('version')} ({conv.get('git_commit')})"],
                ["quantization config sha256", prov.get("quantization_config_sha256")],
                ["tokenizer sha256", info["tokenizer_sha256"]],
                ["calibration", prov.get("calibration")],
                ["topology", info["topology"]],
            ],
        )
    )
    files = info["files"] or []
    console.print(
        table("files", ["path", "bytes", "sha256"], [[f["path"], f["size"], f["sha256"][:16]] for f in files])
    )
    if args.tensors:
        rows = [[e["tensor"], e["file"], e["dtype"], e["shape"], e["bytes"]] for e in info["inventory"]]
        console.print(table("container tensors", ["tensor", "file", "dtype", "shape", "bytes"], rows))
    rows = [
        [
            d["tensor"],
            d["family"],
            d["codes"],
            d["shape"],
            (d["group"] or {}).get("size", "-"),
            d["qparams"],
            d["layout"],
            d["codes_origin"],
        ]
        for d in info["descriptors"]
    ]
    columns = ["tensor", "family", "codes", "shape", "group", "qparams", "layout", "codes from"]
    console.print(table("quantized weights", columns, rows))
    ledger = info["rate_ledger"] or {}
    rows = [[s["scope"], s["bits"], s["per"], f"{s['bits_per_weight']:.4f}"] for s in ledger.get("scopes", [])]
    console.print(table("rate ledger", ["scope", "bits", "per weights", "bits/weight"], rows))
    conversions = info["conversions"] or []
    if conversions:
        rows = [[c["tensor"], c["kind"], c["reason"], c.get("max_abs_err"), c.get("rel_l2")] for c in conversions]
        console.print(table("conversions", ["tensor", "kind", "reason", "max |err|", "rel L2"], rows))
    runtime = info.get("runtime")
    if isinstance(runtime, dict):
        rows = [["timeline", f"{k}: {v:.3f} s"] for k, v in runtime["timeline_s"].items()]
        rows += [["memory", f"{k}: {v} bytes"] for k, v in runtime["memory_bytes"].items()]
        rows += [["kernels", f"{k}: {n} ops"] for k, n in runtime["kernels"].items()]
        rows.append(["fallback", f"{runtime['fallback_fraction']:.1%} of weighted work"])
        rows.append(["rate, loaded memory", f"{runtime['loaded_bits_per_weight']:.4f} bits/weight (kernel buffers)"])
        console.print(table(f"{args.device} load (qcompiler.load, fallback allowed)", ["what", "value"], rows))
    parity = info["parity"] or {}
    r2 = parity.get("rung2_reconstruction", {})
    console.print(
        f"parity at compile time: rung 1 {parity.get('rung1_pack_unpack')}; rung 2 {r2.get('bit_exact')}/"
        f"{r2.get('weights')} bit-exact against {r2.get('reference')}"
    )
    return 0

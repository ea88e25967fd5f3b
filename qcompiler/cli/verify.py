"""qcompiler verify PATH [--json] [--trusted-key PUBLIC.pem]: reopen an artifact through every reader gate
(manifest, file hashes, container, index, inventory, qparams, graph) and re-run the parity rungs it
supports on its own bytes, and (for targets whose runtime is here) what the runtime dispatches. With
--trusted-key, manifest.sig must be a valid signature by that key (see docs/signing.md). Exits non-zero
on any failure, naming the file, tensor and field."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qcompiler.errors import UsageError
from qcompiler.report import verify_artifact


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="artifact directory")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument(
        "--level",
        type=int,
        choices=(3, 4, 5),
        default=3,
        help="3: gates and rungs 1-3; 4: + the runtime against the reference graph (layers, logits, 16 greedy "
        "tokens); 5: + dispatch and resource parity",
    )
    p.add_argument("--fallback", choices=("forbid", "warn", "allow"), default="forbid", help="with --level 4/5")
    p.add_argument(
        "--device", default="cpu", help="with --level 4/5: cpu, cuda, cuda:N or interpret (Triton's CPU interpreter)"
    )
    p.add_argument(
        "--compute",
        choices=("auto", "f32", "bf16"),
        default="auto",
        help="with --level 4/5: the runtime's activation dtype (auto: bf16 for a bf16 source model, else f32); "
        "narrower than the graph, rung 4 compares against a looser bound and excuses near-tie tokens",
    )
    p.add_argument("--jobs", "-j", type=int, default=0, help="threads for rungs 1-3 (default 0: all cores)")
    p.add_argument(
        "--trusted-key",
        metavar="PUBLIC.pem",
        help="require manifest.sig to be a valid Ed25519 signature by this public key (qcompiler keygen)",
    )


def signature_line(s: dict[str, Any]) -> str:
    """``valid (key <id>)``, ``unsigned``, ``signed by key <id>, not checked (no --trusted-key)`` or ``FAILED ...``."""
    if s["status"] == "valid":
        return f"[green]valid[/green] (key {s['key_id']})"
    if s["ok"]:
        return escape(str(s["note"]))
    return f"[red]FAILED[/red] {escape(str(s['status']))}: {escape(str(s['error']))}"


def kernels_line(d: dict[str, Any]) -> str:
    """Triton: ``1 generated kernel(s), interpreter parity max rel 9.9e-08, AOT sm_80, sm_90; <CUDA line>``."""
    ks: list[dict[str, Any]] = d.get("kernels", [])
    worst = max((c["rel_kernel"] for k in ks for c in k["interpreter"] + k.get("cuda", [])), default=0.0)
    targets = sorted({t for k in ks for t in k["aot"]})
    on_gpu = " and CUDA" if any(k.get("cuda") for k in ks) else ""
    head = f"{len(ks)} generated kernel(s), interpreter{on_gpu} parity max rel {worst:.1e}, "
    head += f"AOT {', '.join(targets) or 'none'}"
    status = "[green]passed[/green]" if d.get("ok") else "[red]FAILED[/red]"
    return f"{status} {head}; {d.get('cuda')}"


def dispatch_line(d: dict[str, Any]) -> str:
    """``14/14 quantized linears run as MatMulNBits (accuracy_level [1])``, or what was left behind."""
    if "kernels" in d:
        return kernels_line(d)
    head = f"{d.get('matmulnbits')}/{d.get('quantized_linears')} quantized linears run as MatMulNBits"
    head += f" (accuracy_level {d.get('accuracy_levels')})"
    left = d.get("dequantize_matmul_left")
    if d.get("ok"):
        return f"[green]passed[/green] {head}"
    return f"[red]FAILED[/red] {head}; DequantizeLinear -> MatMul left: {left}"


def run(args: argparse.Namespace) -> int:
    if args.jobs < 0:
        raise UsageError(f"--jobs must be 0 (all cores) or a positive count, found {args.jobs}")
    result = verify_artifact(
        args.path, args.level, args.fallback, args.device, args.trusted_key, jobs=args.jobs, compute=args.compute
    )
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return 0 if result["ok"] else 1
    console = Console()
    table = Table(title=f"verify {args.path}")
    table.add_column("check")
    table.add_column("result")
    if isinstance(result.get("signature"), dict):
        table.add_row("signature", signature_line(result["signature"]))
    for gate in result["gates"]:
        table.add_row(f"gate {gate}", "[green]passed[/green]")
    for rung, r in result["rungs"].items():
        status = "[green]passed[/green]" if not r["failed"] else f"[red]FAILED[/red] {', '.join(r['failed'][:3])}"
        table.add_row(f"rung {rung} ({r['weights']} weights)", status)
    dispatch = result.get("dispatch")
    if isinstance(dispatch, dict):
        for label, d in (("", dispatch), (" (no cache)", dispatch.get("no_cache"))):
            if isinstance(d, dict):
                table.add_row(f"dispatch{label}: {d.get('runtime', '')}", dispatch_line(d))
    console.print(table)
    if not result["ok"]:
        console.print(f"[red]error:[/red] {result['error']}")
        return 1
    console.print("[green]artifact verified[/green]")
    return 0

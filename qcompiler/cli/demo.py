"""qcompiler demo: no arguments. Builds a small Llama-shaped transformers model, quantizes it with the
built-in quantizer (w4-g32; lm_head and embeddings stay float), captures it with torch.export, runs
the whole pipeline (freeze-semantics, canonicalize-axes, place-shards, pack-layouts, fuse-qdq,
emit-container) with the verifier between passes, and publishes a compressed-tensors checkpoint
(--out DIR, default a temporary directory). Then it proves the artifact: it reopens it through
every reader gate, re-runs parity rungs 1-3 on its bytes, runs the artifact's own QIR graph against
the PyTorch model, and loads it with transformers, whose logits must match. --print-ir shows the
final IR. --force lets --out replace a file or a directory that is not an artifact.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

SOURCE = "qcompiler.examples:tiny_llama_hf"
SCHEME = "w4-g32"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="publish the artifact here (default: a temporary directory, removed after)")
    p.add_argument("--force", action="store_true", help="let --out replace something that is not an artifact")
    p.add_argument("--print-ir", action="store_true", help="print the final IR to standard output")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TQDM_DISABLE", "1")  # the peers' progress bars would drown the report
    if args.out:
        from qcompiler.artifact.output import claim_output

        with claim_output(args.out, force=args.force):  # refused or busy before the slow work
            return demo(Path(args.out), args.print_ir, args.force)
    with tempfile.TemporaryDirectory() as tmp:
        return demo(Path(tmp) / "tiny_llama-w4-g32", args.print_ir)


def demo(out: Path, print_ir: bool, force: bool = False) -> int:
    import torch
    import transformers
    from rich.progress import Progress

    from qcompiler.api import capture_source
    from qcompiler.artifact.reader import open_artifact
    from qcompiler.artifact.request import ArtifactRequest
    from qcompiler.ir.interpret import run_graph
    from qcompiler.ir.printer import print_module
    from qcompiler.passes import DEFAULT_PIPELINE
    from qcompiler.passes.base import PassContext
    from qcompiler.passes.manager import PassManager
    from qcompiler.passes.spec import parse_pipeline
    from qcompiler.report import verify_artifact

    console = Console(stderr=print_ir)
    pipeline = DEFAULT_PIPELINE.replace("place-shards", "place-shards{target=safetensors}")
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"quantizing ({SCHEME}) and capturing the example model", total=5)
        c = capture_source(SOURCE, scheme=SCHEME)
        progress.update(task, advance=1, description=f"running {pipeline}")
        request = ArtifactRequest(out, c.source, c.effective, c.float_weights, pipeline=pipeline, force=force)
        m = PassManager(parse_pipeline(pipeline)).run(c.module, PassContext(artifact=request))
        progress.update(task, advance=1, description="reopening the artifact through every gate")
        verified = verify_artifact(out)
        opened = open_artifact(out)
        progress.update(task, advance=1, description="running the artifact's graph against PyTorch")
        ids = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(0))
        assert c.model is not None
        with torch.no_grad():
            want = c.model(ids)
        graph = run_graph(opened.module, [ids])[0]
        progress.update(task, advance=1, description="loading the artifact with transformers")
        hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            got = hf(input_ids=ids).logits
        progress.update(task, advance=1)
    if print_ir:
        sys.stdout.write(print_module(m))
    manifest = opened.manifest or {}
    parity = manifest.get("parity", {})
    scopes = {s["scope"]: s["bits_per_weight"] for s in manifest.get("rate_ledger", {}).get("scopes", [])}
    graph_err = float((graph - want).abs().max())
    hf_err = float((got - graph).abs().max())
    table = Table(title=f"{SOURCE} {SCHEME} -> {out}", title_justify="left")
    table.add_column("check", no_wrap=True)
    table.add_column("result", no_wrap=True)
    rows = [
        ("files", ", ".join(f["path"] for f in manifest.get("files", []))),
        ("reader gates passed", ", ".join(verified["gates"])),
        (
            "rung 1: unpack(pack(Q)) == Q",
            f"{parity['rung1_pack_unpack']['passed']}/{parity['rung1_pack_unpack']['weights']}",
        ),
        (
            "rung 2: artifact decode == model weights",
            f"{parity['rung2_reconstruction']['bit_exact']}/{parity['rung2_reconstruction']['weights']} bit-exact",
        ),
        (
            "rung 3: max rel kernel error",
            f"{verified['rungs'].get('3_operators', {}).get('max_rel_kernel', float('nan')):.1e}",
        ),
        ("bits/weight: codes | + qparams", f"{scopes.get('codes only')} | {scopes.get('codes + qparams')}"),
        ("artifact QIR graph vs PyTorch logits", f"max |diff| = {graph_err:.2e}"),
        ("transformers (compressed-tensors) vs graph", f"max |diff| = {hf_err:.2e}"),
    ]
    for row in rows:
        table.add_row(*row)
    report = Console(stderr=print_ir, width=max(Console().width, 130))
    report.print(table)
    scale = float(want.abs().max())
    ok = bool(verified["ok"]) and graph_err <= 1e-5 * scale and hf_err <= 1e-5 * scale
    report.print("[green]demo passed[/green]" if ok else f"[red]demo FAILED[/red] {verified.get('error', '')}")
    return 0 if ok else 1

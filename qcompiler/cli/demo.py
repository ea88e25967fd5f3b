"""qcompiler demo: no arguments. Builds a small Llama-shaped transformers model, quantizes it with the
built-in quantizer (w4-g32; lm_head and embeddings stay float), captures it with torch.export, runs
freeze-semantics, canonicalize-axes and fuse-qdq with the verifier between them, checks the parity
rungs available so far (pack/unpack, exact reference reconstruction, operator errors, and the whole
graph against the PyTorch model), and prints a summary table. --print-ir shows the final IR.

The artifact writer and the backends are not in this build yet; when they land the demo compiles
to every registered target and verifies each artifact.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

PIPELINE = "freeze-semantics,canonicalize-axes,fuse-qdq"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="seed of the example model's weights")
    p.add_argument("--print-ir", action="store_true", help="print the final IR to standard output")


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.progress import Progress

    import qcompiler
    from qcompiler.api import effective_weights
    from qcompiler.examples import tiny_llama_hf
    from qcompiler.frontend.hf import wrap_hf
    from qcompiler.ir.interpret import run_graph
    from qcompiler.ir.printer import print_module
    from qcompiler.parity import rung1_pack_unpack, rung2_reconstruction, rung3_operators, weights
    from qcompiler.passes.manager import PassManager
    from qcompiler.passes.spec import parse_pipeline

    console = Console(stderr=not args.print_ir)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("building and quantizing the example model", total=4)
        model = tiny_llama_hf(args.seed)
        floats = {
            f"{n}.weight": mod.weight.detach().clone()
            for n, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear)
        }
        qcompiler.quantize(model, "w4-g32")
        progress.update(task, advance=1, description="capturing with torch.export")
        c = wrap_hf(model, "tiny_llama")
        m = qcompiler.capture(c.module, c.inputs, dynamic=c.dynamic, name=c.name)
        progress.update(task, advance=1, description=f"running {PIPELINE}")
        m = PassManager(parse_pipeline(PIPELINE)).run(m)
        progress.update(task, advance=1, description="checking parity")
        rows1, rows2 = rung1_pack_unpack(m), rung2_reconstruction(m, effective_weights(model))
        rows3 = {r.tensor: r for r in rung3_operators(m, {k: v for k, v in floats.items() if k != "lm_head.weight"})}
        ids = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(args.seed))
        graph_err = float((run_graph(m, [ids])[0] - c.module(ids)).abs().max())
        progress.update(task, advance=1)
    if args.print_ir:
        sys.stdout.write(print_module(m))
    table = Table(title=f"module @{m.name}: {len(rows2)} quantized weights, invariants: {', '.join(m.invariants)}")
    table.add_column("weight", no_wrap=True)
    for col in ("descriptor", "pack/unpack", "decode == model", "rel E_kernel", "rel E_quant"):
        table.add_column(col, no_wrap=True)
    types = {name: t for name, _, t in weights(m)}
    for r1, r2 in zip(rows1, rows2, strict=True):
        r3 = rows3.get(r2.tensor)
        t = types[r2.tensor]
        desc = f"{t.family} {t.code.dtype.name} g{t.group.size if t.group else '-'}"
        kern = f"{r3.metrics['rel_kernel']:.1e}" if r3 else "-"
        quant = f"{r3.metrics['rel_quant']:.1e}" if r3 and "rel_quant" in r3.metrics else "-"
        table.add_row(r2.tensor, desc, "ok" if r1.ok else "FAIL", "exact" if r2.ok else "FAIL", kern, quant)
    out = Console(stderr=args.print_ir, width=max(Console().width, 130))
    out.print(table)
    ok = all(r.ok for r in rows1 + rows2) and graph_err < 1e-4
    n_ops = sum(len(g.ops) for g in m.graphs)
    out.print(f"{n_ops} ops verified after every pass; QIR graph vs PyTorch logits: max |diff| = {graph_err:.2e}")
    out.print("[green]demo passed[/green]" if ok else "[red]demo FAILED[/red]")
    return 0 if ok else 1

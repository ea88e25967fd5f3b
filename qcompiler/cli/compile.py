"""qcompiler compile SOURCE [--scheme S] [--stop-after PASS] [--dump-ir DIR] [-o OUT.qir]: load a model
(an HF-style directory or pkg.module:factory), quantize it with the built-in quantizer when --scheme
is given (codes are frozen from then on), capture it with torch.export, and run the pass pipeline.

The final IR goes to -o (or standard output); a summary with the parity rungs goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from qcompiler.errors import UsageError
from qcompiler.ir.blobs import relocate_to_files
from qcompiler.ir.printer import print_module
from qcompiler.passes import DEFAULT_PIPELINE
from qcompiler.passes.manager import Instrumentation, PassManager
from qcompiler.passes.spec import format_pipeline, parse_pipeline

if TYPE_CHECKING:
    from qcompiler.api import Captured
    from qcompiler.ir.core import Module


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="HF-style model directory (config.json + safetensors) or pkg.module:factory")
    p.add_argument(
        "-o",
        "--output",
        help="write the final IR here, its tensors beside it in blobs/ (default: IR to standard output)",
    )
    p.add_argument(
        "--scheme", help="quantize a float model first: w8-channel, w8-g32, w4-g32, w4-g128-asym, w2-g16-asym"
    )
    p.add_argument("--embeddings", action="store_true", help="with --scheme: quantize embedding tables too")
    p.add_argument("--pipeline", "-p", default=DEFAULT_PIPELINE, help="pass pipeline (default: the full pipeline)")
    p.add_argument("--stop-after", metavar="PASS", help="run the pipeline up to and including PASS")
    p.add_argument("--dump-ir", metavar="DIR", help="write input.qir, then NN_<pass>.qir after every pass")
    p.add_argument("--print-ir-after-all", action="store_true", help="print the IR after every pass (to stderr)")
    p.add_argument("--no-verify", action="store_true", help="do not verify between passes")


def truncate(spec: str, stop_after: str | None) -> str:
    passes = parse_pipeline(spec)
    if stop_after is None:
        return spec
    names = [p.name for p in passes]
    if stop_after not in names:
        raise UsageError(f"--stop-after {stop_after}: not in the pipeline ({', '.join(names)})")
    return format_pipeline(passes[: names.index(stop_after) + 1])


def run(args: argparse.Namespace) -> int:
    from qcompiler.api import capture_source

    spec = truncate(args.pipeline, args.stop_after)
    PassManager(parse_pipeline(spec))  # reject a malformed spec before the slow capture
    console = Console(stderr=True, width=max(Console(stderr=True).width, 150))
    with console.status(f"capturing {args.source} with torch.export"):
        captured = capture_source(args.source, scheme=args.scheme, embeddings=args.embeddings)
    m = captured.module
    dump = Path(args.dump_ir) if args.dump_ir else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "input.qir").write_text(f"// remaining-pipeline: {spec}\n" + print_module(relocate_to_files(m, dump)))
    instrument = Instrumentation(verify_each=not args.no_verify, print_after_all=args.print_ir_after_all, dump_dir=dump)
    m = PassManager(parse_pipeline(spec), instrument).run(m)
    if args.output:
        out = Path(args.output)
        out.write_text(print_module(relocate_to_files(m, out.parent)))
    else:
        sys.stdout.write(print_module(m))
    console.print(summary(captured, m))
    return 0


def summary(captured: Captured, m: Module) -> Table:
    from qcompiler.parity import rung1_pack_unpack, rung2_reconstruction, rung3_operators

    rows1, rows2 = rung1_pack_unpack(m), rung2_reconstruction(m, captured.effective)
    rows3 = {r.tensor: r for r in rung3_operators(m, captured.float_weights)}
    table = Table(
        title=f"module @{m.name}: {len(rows2)} quantized weights, invariants {', '.join(m.invariants) or 'none'}"
    )
    table.add_column("weight", no_wrap=True)
    for col in ("pack/unpack", "decode == source", "rel E_kernel", "rel E_quant"):
        table.add_column(col, no_wrap=True)
    for r1, r2 in zip(rows1, rows2, strict=True):
        r3 = rows3.get(r2.tensor)
        kern = f"{r3.metrics['rel_kernel']:.2e}" if r3 else "-"
        quant = f"{r3.metrics['rel_quant']:.2e}" if r3 and "rel_quant" in r3.metrics else "-"
        table.add_row(r2.tensor, "ok" if r1.ok else "FAIL", "exact" if r2.ok else f"FAIL {r2.detail}", kern, quant)
    return table

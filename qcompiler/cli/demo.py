"""qcompiler demo: build the built-in tiny Llama-shaped example, verify it (types, descriptors and
tensor bytes), print its IR and a summary table. No arguments needed.

The frontend, artifact writer and backends are not in this build yet; when they land the demo
compiles the example to every registered target and verifies each artifact.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from qcompiler.examples import tiny_llama
from qcompiler.ir.core import Module
from qcompiler.ir.printer import print_module
from qcompiler.ir.verifier import verify_module


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="seed of the example's pseudo-random codes")


def summary(m: Module) -> Table:
    table = Table(title=f"module @{m.name}: quantized weights")
    for col in ("weight", "descriptor", "shape", "group", "claimed rate (bits/weight)"):
        table.add_column(col)
    for op in m.ops():
        t = op.results[0].quant if op.name == "q.weight" else None
        if t is None:
            continue
        rate = f"{t.rate.bits / t.rate.per:.4g} ({'+'.join(t.rate.incl)})" if t.rate else "-"
        group = f"{t.group.size} along axis {t.group.axis}" if t.group else "per-tensor"
        shape = "x".join(str(d) for d in t.shape)
        codes = op.attrs["codes"]
        table.add_row(
            str(codes).removesuffix(".codes"), f"{t.family} {t.code.dtype.name}{t.code.alphabet}", shape, group, rate
        )
    return table


def run(args: argparse.Namespace) -> int:
    m = tiny_llama(seed=args.seed)
    verify_module(m, data=True)
    sys.stdout.write(print_module(m))
    console = Console()
    console.print(summary(m))
    n_ops = sum(len(g.ops) for g in m.graphs)
    console.print(f"verified: {n_ops} ops, {len(m.tensors)} tensors (types, descriptors, sha256, code ranges)")
    return 0

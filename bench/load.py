"""Load-to-ready: ``qcompiler.load`` (every reader gate, sha256 of every file, kernel admission, repack,
warmup self-check) against ``safetensors.torch.load_file`` of the same checkpoint bytes, in the same process.

A seeded Llama (``--hidden`` 1024, ``--layers`` 4, intermediate 2816, vocab 2048) is quantized
``w4-g32`` and compiled to a compressed-tensors artifact. Both loaders read it with the page cache
warm (a first read is discarded), best of ``--repeat``. The ratio is the peer's time (every byte touched)
over each row's time (below 1: slower, by the price of verification); our stages come from ``LoadedModel.timeline``.
``load_file`` maps the file lazily, so a second row also touches every byte.

    python bench/load.py [--hidden 1024] [--layers 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    import safetensors.torch
    import torch

    import qcompiler
    from qcompiler.testing import run_cli

    sys.path.insert(0, str(Path(__file__).parent))
    from onnx_runtime import make_model  # the same seeded model as the onnxruntime bench

    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "llama", Path(tmp) / "w4"
        make_model(src, args.hidden, args.layers)
        with console.status("compiling"):
            r = run_cli("compile", str(src), "--scheme", "w4-g32", "--target", "safetensors", "-o", str(out))
            assert r.code == 0, r.err
        files = sorted(out.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in out.iterdir())
        for f in files:
            f.read_bytes()
        peer, touched, ours, stages = [], [], [], {}
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            tensors = {}
            for f in files:
                tensors.update(safetensors.torch.load_file(f))
            peer.append(time.perf_counter() - t0)
            for t in tensors.values():  # every byte read (the mapping is lazy)
                t.view(-1).view(torch.uint8).sum() if t.numel() else None
            touched.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            lm = qcompiler.load(out)
            ours.append(time.perf_counter() - t0)
            if ours[-1] == min(ours):
                stages = dict(lm.timeline)
    table = Table(title=f"load-to-ready, llama hidden {args.hidden} x {args.layers}, w4-g32, {size / 2**20:.1f} MiB")
    for col in ("loader", "best s", "peer (touched) / this"):
        table.add_column(col, justify="right")
    table.add_row("safetensors.torch.load_file (lazy)", f"{min(peer):.3f}", f"{min(touched) / min(peer):.1f}x")
    table.add_row("  + every byte touched", f"{min(touched):.3f}", "1.00x")
    table.add_row("qcompiler.load (all gates)", f"{min(ours):.3f}", f"{min(touched) / min(ours):.3f}x")
    for name, s in stages.items():
        table.add_row(f"  {name}", f"{s:.3f}", "")
    console.print(table)


if __name__ == "__main__":
    main()

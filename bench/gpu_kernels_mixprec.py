"""The mixed 2/4-bit Triton kernels (``mixprec``: 2-bit groups, some 4-bit groups, fp16 outliers,
second-level-quantized scales) on one CUDA device, against torch fp16 ``matmul`` and the generated W4 g128
kernel of ``bench/gpu_kernels.py``.

For (N, K) in (4096, 4096) and (4096, 14336) and M = 1..16, a random float weight is quantized by
``mixprec_run.random_weight`` (``--wide`` of the groups 4-bit, ``--outliers`` of the elements fp16) and
run through the ``decode`` kernel. Correctness first: the output against the fp32 product with the
reference decode (relative L2, bound 1e-2). Timing reuses ``gpu_kernels.timed`` (CUDA graph of a pass over
enough weight copies to exceed twice the L2, median of ``--reps``). % of peak HBM counts every stream the
kernel reads or writes: low plane, high plane, ``hbase``/``hrank``, zero points, scale codes, the second
level (``scale2``, ``zero2``), the outliers (row pointers, columns, values, tile counts), x and y.
Speedup = peer time / our time, for torch fp16 ``matmul`` on the decoded weight and for the W4 g128 kernel.

Without a CUDA device it says so and exits 0 (the interpreter checks live in tests/test_triton_mixprec.py).
``bench/gpu_kernels.py`` prints the same rows (``bench_mixprec`` with the defaults) after its own.

    python bench/gpu_kernels_mixprec.py [--group 128] [--group2 128] [--wide 0.25] [--outliers 0.005] [--reps 50]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

import numpy as np
import torch
from gpu_kernels import copies_for, peak_hbm, timed

SHAPES = ((4096, 4096), (4096, 14336))
MS = tuple(range(1, 17))
ERROR_BOUND = 1e-2


def stream_bytes(h: dict[str, Any], m: int, act: int, out: int) -> int:
    """Every byte the decode reads or writes once: the weight's tensors, x and y."""
    weight = sum(int(t.numel() * t.element_size()) for t in h.values() if isinstance(t, torch.Tensor))
    return weight + m * h["k"] * act + m * h["n"] * out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--group2", type=int, default=128)
    p.add_argument("--wide", type=float, default=0.25, help="fraction of groups stored 4-bit")
    p.add_argument("--outliers", type=float, default=0.005, help="fraction of elements kept as fp16 outliers")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_kernels_mixprec.py needs a CUDA GPU and torch sees none; nothing measured")
        sys.exit(0)
    bench_mixprec(args.group, args.group2, args.wide, args.outliers, args.reps)


def bench_mixprec(
    group: int = 128, group2: int = 128, wide: float = 0.25, outliers: float = 0.005, reps: int = 50
) -> None:
    """Print the rows (see the module docstring) on CUDA device 0."""
    from qcompiler.backends.triton.codegen import KernelKey
    from qcompiler.backends.triton.layouts import pack_kn
    from qcompiler.backends.triton.mixprec_codegen import MixKey
    from qcompiler.backends.triton.mixprec_run import prepare, random_weight, run_mixprec
    from qcompiler.backends.triton.runtime import handle, run_linear
    from qcompiler.runtime.kernels import Place

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    peak, source = peak_hbm(props)
    l2 = int(getattr(props, "L2_cache_size", 0)) or 64 * 2**20
    place = Place("cuda", dev, False, props.major + props.minor / 10, props.multi_processor_count)
    key = MixKey("f16", "f16", group, group2)
    w4 = KernelKey("linear", 4, True, 128, False, False, "f16", "f16", "f16", False)
    w4_run = run_linear(w4, "decode")
    print(f"{props.name}: peak HBM {peak or 0:.3g} B/s ({source}), L2 {l2 / 2**20:.0f} MiB; kernel {key.id}")
    print(f"{'M':>3} {'N x K':>12} {'rel err':>8} {'us':>8} {'GB/s':>7} {'%peak':>6} {'fp16 us':>8} {'x fp16':>7} "
          f"{'w4 us':>7} {'x w4':>6}")  # fmt: skip
    for n, k in SHAPES:
        w, _ = random_weight(n, k, group, group2, wide, outliers, seed=n + k)
        h = prepare(key, w, dev, False, props.multi_processor_count)
        dense = torch.from_numpy(w.decode()).to(dev)
        wbytes = stream_bytes(h, 0, 2, 2)
        ours = [h] + [
            h | {"lo": torch.randint(0, 256, tuple(h["lo"].shape), dtype=torch.uint8, device=dev)}
            for _ in range(copies_for(wbytes, l2) - 1)
        ]  # random low planes: the same streams, distinct addresses (outliers and scales shared)
        fp16 = [dense.half()]
        fp16 += [torch.randn(n, k, dtype=torch.float16, device=dev) for _ in range(copies_for(2 * n * k, l2) - 1)]
        codes = np.random.default_rng(0).integers(-8, 8, (n, k), dtype=np.int16)
        scale = torch.rand(n, k // 128) * 0.02 + 0.005
        w4h = [handle(w4, torch.from_numpy(pack_kn(codes, 4, 8)), scale.half(), None, None, k, place)
               for _ in range(copies_for(n * k // 2, l2))]  # fmt: skip
        for m in MS:
            x = torch.randn(m, k, device=dev).half()
            got = run_mixprec(key, "decode", h, x).float()
            want = x.float() @ dense.T
            err = float((got - want).norm() / want.norm().clamp_min(1e-30))
            if not err <= ERROR_BOUND:
                raise SystemExit(f"{key.id} M={m} N={n} K={k}: relative L2 error {err:.2e} > {ERROR_BOUND}")
            t = timed([partial(run_mixprec, key, "decode", c, x) for c in ours], reps, True, True)
            t16 = timed([partial(torch.matmul, x, d.T) for d in fp16], reps, True, True)
            t4 = timed([partial(w4_run, c, x, None) for c in w4h], reps, True, True)
            total = stream_bytes(h, m, 2, 2)
            pct = 100 * total / t / peak if peak else float("nan")
            print(f"{m:>3} {f'{n}x{k}':>12} {err:>8.1e} {t * 1e6:>8.1f} {total / t / 1e9:>7.0f} {pct:>6.1f} "
                  f"{t16 * 1e6:>8.1f} {t16 / t:>6.2f}x {t4 * 1e6:>7.1f} {t4 / t:>5.2f}x")  # fmt: skip
        del ours, fp16, w4h, dense
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Generated low-bit Triton linear kernels against torch fp16 ``F.linear`` on one CUDA device, plus one
end-to-end greedy decode of a Llama-shaped model against transformers in fp16 eager.

Kernels: for M in 1, 4, 16, 64, 256 and (N, K) in (4096, 4096), (14336, 4096), (4096, 14336), the
``q.linear`` kernels generated for one ``KernelKey`` (default W4 g128 symmetric; fp16 activations, scales
and output) run on random codes packed by ``pack_kn``: the ``decode`` phase (split-K GEMM + reduce) for
M <= 16, ``prefill`` (tiled GEMM) above. Correctness comes first: every shape is checked against
``F.linear`` on the dequantized fp16 weight (computed in fp32; relative L2 error, bound 1e-2).

Timing: CUDA events, warm-up, median of ``--reps`` samples. Each sample is one pass of at least 32 calls
that read several independent weight copies in turn (ours and the fp16 peer's alike), together over twice
the L2 cache, so every call streams its weight from HBM. The main columns replay the pass as a CUDA graph
(kernel time, no launch overhead); "eager" issues the same calls from Python (launch overhead included).
Bandwidth = (codes + scales (+ zero points) + activations + output bytes) / latency, against the
device's peak HBM bandwidth (a table by device name, else 2 x memory clock x bus width). Speedup = fp16
time / our time (above 1: ours is faster). Goals for W4 g128: >= 75% of peak at M=1, >= 3x fp16 at M <= 16.

End-to-end: a seeded Llama (random weights; hidden 4096, intermediate 14336, 32 heads / 8 KV heads, vocab
32000, ``--layers`` 2) in fp16 is compiled ``--target triton`` with the matching scheme (from an in-process
factory, so the graph keeps fp16 activations; the built-in quantizer keeps fp32 scales) and loaded on the
GPU. Its dispatch trace is summarised (every quantized op must select a ``triton.*`` kernel), then both it
and transformers' model (fp16, eager, KV cache) decode ``--tokens`` tokens greedily after an 8-token prompt
at batch 1; the rate excludes the prefill and two warm-up steps. Our runtime executes the QIR graph op by
op from Python (no CUDA graph), so this measures the whole stack, not the kernels alone.

``--interpret`` runs the same code on the CPU through Triton's interpreter, on tiny shapes and a tiny model
(perf_counter timing, no bandwidth; the end-to-end peer runs in float32): CI runs it to prove the script works.

Mixed 2/4-bit rows: on a CUDA device the script then prints ``bench/gpu_kernels_mixprec.py``'s rows (the
``mixprec`` decode kernel, G = G2 = 128, a quarter of the groups 4-bit, 0.5% outliers) against fp16 and the
W4 g128 kernel; with ``--interpret`` it says they need a GPU (their interpreter checks are tests).

    python bench/gpu_kernels.py [--bits 4] [--group 128] [--asym] [--reps 50] [--layers 2] [--skip-e2e] [--json PATH]
    python bench/gpu_kernels.py --interpret
"""

from __future__ import annotations

import argparse
import copy
import datetime
import inspect
import json
import statistics
import sys
import tempfile
import time
import types
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

PROMPT = [1, 5, 17, 99, 3, 42, 7, 8]
DECODE_MAX_M = 16
ERROR_BOUND = 1e-2
MIN_CALLS = 32
"""Calls per timed sample on CUDA (so one event pair or one graph launch spans many kernels)."""
MAX_COPIES = 64
PEAK_HBM: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H200",), 4.8e12),
    (("H100", "PCIe"), 2.0e12),
    (("H100",), 3.35e12),
    (("A100", "80GB"), 2.04e12),
    (("A100",), 1.555e12),
    (("L40S",), 0.864e12),
    (("A10",), 0.6e12),
)
"""Peak HBM bytes/s by device name substrings (all must match; the first matching row wins)."""
GPU = {"ms": (1, 4, 16, 64, 256), "shapes": ((4096, 4096), (14336, 4096), (4096, 14336))}
TINY = {"ms": (1, 4, 17), "shapes": ((64, 128), (96, 256))}
E2E_GPU = {"e2e_hidden": 4096, "e2e_intermediate": 14336, "heads": 32, "kv_heads": 8, "vocab": 32000, "tokens": 32}
E2E_TINY = {"e2e_hidden": 64, "e2e_intermediate": 256, "heads": 4, "kv_heads": 2, "vocab": 128, "tokens": 4}


def peak_hbm(props: Any) -> tuple[float | None, str]:
    """(peak bytes/s, where it came from) for a ``torch.cuda`` device's properties."""
    name = str(props.name).lower()
    for subs, peak in PEAK_HBM:
        if all(s.lower() in name for s in subs):
            return peak, f"table ({' + '.join(subs)})"
    clock, width = int(getattr(props, "memory_clock_rate", 0)), int(getattr(props, "memory_bus_width", 0))
    if clock and width:  # kHz, bits; double data rate
        return 2 * clock * 1e3 * width / 8, f"2 x memory clock {clock / 1e6:.3f} GHz x {width}-bit bus"
    return None, "unknown"


def timed(fns: Sequence[Callable[[], object]], reps: int, cuda: bool, graph: bool = False) -> float:
    """Median seconds per call; the calls rotate over ``fns`` (one per weight copy)."""
    import torch

    for f in fns:  # warm-up: compiles, touches every copy
        f()
    if not cuda:
        samples: list[float] = []
        for i in range(reps):
            start = time.perf_counter()
            fns[i % len(fns)]()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)
    calls = list(fns) * -(-MIN_CALLS // len(fns))

    def one_pass() -> None:
        for f in calls:
            f()

    run_pass: Callable[[], object] = one_pass
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            one_pass()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            one_pass()
        run_pass = g.replay
    run_pass()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        run_pass()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3 / len(calls)


def copies_for(nbytes: int, l2: int) -> int:
    return max(2, min(MAX_COPIES, -(-2 * l2 // nbytes)))


def kernels(
    args: argparse.Namespace, cfg: dict[str, Any], cuda: bool, l2: int, peak: float | None
) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from qcompiler.backends.triton.codegen import KernelKey
    from qcompiler.backends.triton.layouts import pack_kn
    from qcompiler.backends.triton.runtime import handle, run_linear
    from qcompiler.ir.interpret import TORCH
    from qcompiler.runtime.kernels import Place

    key = KernelKey("linear", args.bits, not args.asym, args.group, args.asym, False, "f16", "f16", "f16", False)
    if cuda:
        props = torch.cuda.get_device_properties(0)
        place = Place("cuda", torch.device("cuda"), False, props.major + props.minor / 10, props.multi_processor_count)
    else:
        place = Place("cuda", torch.device("cpu"), True, 8.0, 8)
    dev, act, out = place.torch_device, TORCH[key.act], TORCH[key.out]
    runs = {phase: run_linear(key, phase) for phase in ("decode", "prefill")}
    rows: list[dict[str, Any]] = []
    for n, k in cfg["shapes"]:
        groups, size = (k // key.group, key.group) if key.group else (1, k)
        gen = torch.Generator().manual_seed(n * 31 + k)
        lo, hi = (-key.offset, key.offset) if key.signed else (0, 1 << key.bits)
        codes = np.random.default_rng(n * 31 + k).integers(lo, hi, (n, k), dtype=np.int16)
        scale = (torch.rand(n, groups, generator=gen) * 0.02 + 0.005).to(TORCH[key.scale])
        zero = torch.randint(0, 1 << key.bits, (n, groups), generator=gen, dtype=torch.int32) if key.zero else None
        packed = torch.from_numpy(pack_kn(codes, key.bits, key.offset))
        w = torch.from_numpy(codes).to(dev).float().reshape(n, groups, size)
        if zero is not None:
            w = w - zero.to(dev).float()[:, :, None]
        dense0 = (w * scale.to(dev).float()[:, :, None]).reshape(n, k).to(torch.float16)
        del w
        qbytes = packed.numel() + scale.numel() * scale.element_size() + (4 * zero.numel() if zero is not None else 0)
        ours = [handle(key, packed, scale, zero, None, k, place)]
        for _ in range(copies_for(qbytes, l2) - 1):  # any byte is a valid packed code: random copies
            codes_i = torch.randint(0, 256, tuple(packed.shape), dtype=torch.uint8, device=dev)
            ours.append(handle(key, codes_i, scale.clone(), None if zero is None else zero.clone(), None, k, place))
        dense = [dense0] + [
            torch.randn(n, k, dtype=torch.float16, device=dev) for _ in range(copies_for(2 * n * k, l2) - 1)
        ]
        xs = {m: torch.randn(m, k, generator=gen).to(act).to(dev) for m in cfg["ms"]}
        phases = {m: "decode" if m <= DECODE_MAX_M else "prefill" for m in cfg["ms"]}
        errs: dict[int, float] = {}
        for m, x in xs.items():  # correctness before speed
            got = runs[phases[m]](ours[0], x, None).float()
            want = F.linear(x.float(), dense0.float())
            errs[m] = float((got - want).norm() / want.norm().clamp_min(1e-30))
            if not errs[m] <= ERROR_BOUND:
                raise SystemExit(
                    f"{key.id} {phases[m]} M={m} N={n} K={k}: relative L2 error {errs[m]:.2e} > {ERROR_BOUND}"
                )
        for m, x in xs.items():
            fns = [partial(runs[phases[m]], h, x, None) for h in ours]
            peers = [partial(F.linear, x, d) for d in dense]
            io = m * k * x.element_size() + m * n * torch.finfo(out).bits // 8
            row: dict[str, Any] = {"m": m, "n": n, "k": k, "phase": phases[m], "rel_err": errs[m]}
            row |= {"copies": len(ours), "fp16_copies": len(dense), "bytes": qbytes + io, "fp16_bytes": 2 * n * k + io}
            row["ours_eager_s"], row["fp16_eager_s"] = timed(fns, args.reps, cuda), timed(peers, args.reps, cuda)
            row["timing"] = "cuda graph" if cuda else "perf_counter (interpreter)"
            row["ours_s"], row["fp16_s"] = row["ours_eager_s"], row["fp16_eager_s"]
            if cuda:
                try:
                    row["ours_s"] = timed(fns, args.reps, cuda, True)
                    row["fp16_s"] = timed(peers, args.reps, cuda, True)
                except Exception as e:  # keep the eager numbers
                    row["timing"] = f"cuda events, eager (graph capture failed: {str(e).strip()[:200]})"
            row["speedup"] = row["fp16_s"] / row["ours_s"]
            row["eager_speedup"] = row["fp16_eager_s"] / row["ours_eager_s"]
            row["gbps"] = row["bytes"] / row["ours_s"] / 1e9 if cuda else None
            row["fp16_gbps"] = row["fp16_bytes"] / row["fp16_s"] / 1e9 if cuda else None
            row["pct_peak"] = 100 * row["bytes"] / row["ours_s"] / peak if cuda and peak else None
            rows.append(row)
        del ours, dense, dense0, xs
        if cuda:
            torch.cuda.empty_cache()
    return rows


def decode_rate(step: Callable[[Any], Any], tokens: int, cuda: bool) -> float:
    """Greedy tokens/s at batch 1 after the prompt and two warm-up steps."""
    import torch

    with torch.no_grad():
        nxt = step(torch.tensor([PROMPT]))[:, -1].argmax(-1)[:, None]
        for _ in range(2):
            nxt = step(nxt)[:, -1].argmax(-1)[:, None]
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(tokens):
            nxt = step(nxt)[:, -1].argmax(-1)[:, None]
        if cuda:
            torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)


def hf_stepper(model: Any, dev: Any) -> Callable[[Any], Any]:
    """One forward of transformers' model with its KV cache (``cache``; ``past_key_values`` before 5.x)."""
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    past: list[Any] = [None]

    def step(ids: Any) -> Any:
        out = model(input_ids=ids.to(dev), use_cache=True, **{kw: past[0]})
        past[0] = getattr(out, kw)
        return out.logits

    return step


def e2e(args: argparse.Namespace, cuda: bool, console: Console) -> dict[str, Any]:
    import torch
    import transformers

    import qcompiler
    from qcompiler.testing import run_cli

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.e2e_hidden,
        intermediate_size=args.e2e_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        tie_word_embeddings=False,
    )
    model: Any = transformers.LlamaForCausalLM(cfg).eval().half()
    scheme = f"w{args.bits}-{f'g{args.group}' if args.group else 'channel'}{'-asym' if args.asym else ''}"
    res: dict[str, Any] = {"scheme": scheme, "config": {k.removeprefix("e2e_"): getattr(args, k) for k in E2E_GPU}}
    res["config"]["layers"] = args.layers
    # An in-process factory keeps the model's fp16 (a model directory is read as float32), so the
    # compiled graph runs the fp16-activation kernels the table above measures.
    factory = types.ModuleType("qc_bench_gpu_models")
    factory.__dict__["llama"] = lambda: copy.deepcopy(model)  # the compile quantizes its model in place
    sys.modules[factory.__name__] = factory
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "triton"
        start = time.perf_counter()
        with console.status(f"compiling {scheme} -> triton"):
            r = run_cli(
                "compile", f"{factory.__name__}:llama", "--scheme", scheme, "--target", "triton", "-o", str(out)
            )
        if r.code != 0:
            raise SystemExit(f"qcompiler compile --target triton failed (exit {r.code}):\n{r.err[-3000:]}")
        res["compile_s"] = time.perf_counter() - start
        start = time.perf_counter()
        lm = qcompiler.load(out, device="cuda" if cuda else "interpret", fallback="forbid")
        res["load_s"] = time.perf_counter() - start
        trace = lm.trace()
        counts = Counter((str(d["phase"]), str(d["selected"])) for d in trace)
        res["dispatch"] = [{"phase": p, "kernel": kid, "ops": c} for (p, kid), c in sorted(counts.items())]
        res["activations"] = sorted({str(d["signature"]["activation"]) for d in trace})
        wrong = sorted({kid for _, kid in counts if not kid.startswith("triton.")})
        if wrong:
            raise SystemExit(f"dispatch selected non-triton kernels: {', '.join(wrong)}")
        res["ours_tok_s"] = decode_rate(qcompiler.Session(lm).step, args.tokens, cuda)
    dev = torch.device("cuda" if cuda else "cpu")
    peer = model.to(dev) if cuda else model.float()  # the CPU's fp16 matmuls are not what a GPU run compares to
    res["peer"] = f"transformers eager {'fp16' if cuda else 'float32'} ({dev.type})"
    res["peer_tok_s"] = decode_rate(hf_stepper(peer, dev), args.tokens, cuda)
    res["ratio"] = res["ours_tok_s"] / res["peer_tok_s"]
    return res


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def report(console: Console, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    console.print(
        f"{meta['date']}  {meta['device']}  torch {meta['torch']}  triton {meta['triton']}\n"
        f"kernel {meta['key']}  peak HBM {fmt(meta['peak_hbm'], '.3g')} B/s from {meta['peak_source']}  "
        f"L2 {fmt(meta['l2_bytes'] / 2**20 or None, '.0f')} MiB  timing: {rows[0]['timing'] if rows else '-'}"
    )
    table = Table(title=f"q.linear {meta['key']} vs torch fp16 F.linear (speedup = fp16 / ours)")
    cols = ("M", "N x K", "phase", "rel err", "copies", "ours µs", "GB/s", "% peak", "fp16 µs", "fp16 GB/s")
    for col in (*cols, "speedup", "eager speedup"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["m"]), f"{r['n']} x {r['k']}", r["phase"], f"{r['rel_err']:.1e}", f"{r['copies']}/{r['fp16_copies']}",
            f"{r['ours_s'] * 1e6:.1f}", fmt(r["gbps"], ".0f"), fmt(r["pct_peak"], ".1f"), f"{r['fp16_s'] * 1e6:.1f}",
            fmt(r["fp16_gbps"], ".0f"), f"{r['speedup']:.2f}x", f"{r['eager_speedup']:.2f}x",
        )  # fmt: skip
    console.print(table)
    m1 = [r["pct_peak"] for r in rows if r["m"] == 1 and r["pct_peak"] is not None]
    small = [r["speedup"] for r in rows if r["m"] <= DECODE_MAX_M]
    if m1:
        console.print(f"goal >= 75% of peak at M=1: worst {min(m1):.1f}% ({'met' if min(m1) >= 75 else 'missed'})")
    if small and meta["cuda"]:
        console.print(f"goal >= 3x fp16 at M <= 16: worst {min(small):.2f}x ({'met' if min(small) >= 3 else 'missed'})")


def report_e2e(console: Console, e2e_res: dict[str, Any]) -> None:
    c = e2e_res["config"]
    t = Table(title=f"dispatch trace, llama hidden {c['hidden']} x {c['layers']} layers, {e2e_res['scheme']} -> triton")
    for col in ("phase", "kernel", "ops"):
        t.add_column(col)
    for d in e2e_res["dispatch"]:
        t.add_row(d["phase"], d["kernel"], str(d["ops"]))
    console.print(t)
    console.print(
        f"activations {', '.join(e2e_res['activations'])}; "
        f"compile {e2e_res['compile_s']:.1f} s, load {e2e_res['load_s']:.1f} s"
    )
    t = Table(title=f"greedy decode, batch 1, {c['tokens']} tokens after an {len(PROMPT)}-token prompt")
    for col in ("runtime", "tokens/s", "ours / this"):
        t.add_column(col, justify="right")
    t.add_row("qcompiler (triton kernels)", f"{e2e_res['ours_tok_s']:.1f}", "1.00x")
    t.add_row(e2e_res["peer"], f"{e2e_res['peer_tok_s']:.1f}", f"{e2e_res['ratio']:.2f}x")
    console.print(t)


def mixprec_rows(cuda: bool, reps: int) -> None:
    """The mixed 2/4-bit kernel's rows (``gpu_kernels_mixprec.py``), on a CUDA device only."""
    if not cuda:
        print("mixprec rows: need a CUDA device (bench/gpu_kernels_mixprec.py; interpreter checks are tests)")
        return
    from gpu_kernels_mixprec import bench_mixprec  # beside this script (it imports this one's timers)

    bench_mixprec(reps=reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interpret", action="store_true", help="tiny shapes on the CPU through Triton's interpreter")
    p.add_argument("--bits", type=int, choices=(2, 4, 8), default=4)
    p.add_argument("--group", type=int, default=128, help="group size along K; 0: per channel")
    p.add_argument("--asym", action="store_true", help="unsigned codes with an int zero point")
    p.add_argument("--reps", type=int, help="timed samples per measurement (default 50; 3 with --interpret)")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--layers", type=int, default=2)
    for name in E2E_GPU:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"end-to-end model (default {E2E_GPU[name]})")
    p.add_argument("--json", type=Path, help="write every result here")
    args = p.parse_args()
    import torch

    cuda = not args.interpret
    if cuda and not torch.cuda.is_available():
        print(
            "bench/gpu_kernels.py needs a CUDA device and torch sees none; --interpret runs the same code paths "
            "on the CPU through Triton's interpreter, on tiny shapes",
            file=sys.stderr,
        )
        sys.exit(2)
    import triton

    for name, default in (E2E_GPU if cuda else E2E_TINY).items():
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    args.reps = args.reps or (50 if cuda else 3)
    console = Console() if sys.stdout.isatty() else Console(width=160)  # logs: no truncated columns
    meta: dict[str, Any] = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "cuda": cuda}
    meta |= {"torch": torch.__version__, "triton": triton.__version__, "l2_bytes": 0, "peak_hbm": None}
    meta["peak_source"] = "not measured (interpreter)"
    meta["device"] = "Triton interpreter (CPU)"
    if cuda:
        props = torch.cuda.get_device_properties(0)
        meta["device"] = f"{props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs)"
        meta["l2_bytes"] = int(getattr(props, "L2_cache_size", 0)) or 64 * 2**20
        meta["peak_hbm"], meta["peak_source"] = peak_hbm(props)
    from qcompiler.backends.triton.codegen import KernelKey

    meta["key"] = KernelKey(
        "linear", args.bits, not args.asym, args.group, args.asym, False, "f16", "f16", "f16", False
    ).id
    rows = kernels(args, GPU if cuda else TINY, cuda, meta["l2_bytes"], meta["peak_hbm"])
    report(console, meta, rows)
    results: dict[str, Any] = {"meta": meta, "kernels": rows, "e2e": None}
    if args.json:  # written now too: the kernels' results survive a failing end-to-end run
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    mixprec_rows(cuda, args.reps)
    if not args.skip_e2e:
        results["e2e"] = e2e(args, cuda, console)
        report_e2e(console, results["e2e"])
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""qcompiler run PATH --tokens 1,2,3 [--max-new-tokens N] [--fallback forbid|warn|allow] [--compute auto|f32|bf16]
[--trace] [--json]:
load an artifact (every reader gate, kernel admission, materialisation, self-check), run its graph on
the tokens with the selected CPU kernels, and decode greedily with a KV cache (causal LMs). Prints a
logits summary, the generated tokens, the startup timeline and memory ledger, and with --trace the
dispatch trace: every quantized op's signature, each candidate kernel accepted or rejected with its
reason, and the kernel selected per phase (prefill, decode)."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

from rich.console import Console
from rich.table import Table

from qcompiler.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="artifact directory")
    p.add_argument("--tokens", required=True, help="comma-separated token ids of one prompt, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=0, help="greedy tokens to generate (causal LMs)")
    p.add_argument("--fallback", choices=("forbid", "warn", "allow"), default="forbid")
    p.add_argument(
        "--device", default="cpu", help="cpu, cuda, cuda:N, or interpret (the CUDA kernels on Triton's CPU interpreter)"
    )
    p.add_argument(
        "--compute",
        choices=("auto", "f32", "bf16"),
        default="auto",
        help="activation dtype of the quantized linears (auto: bf16 for a bf16 source model, else f32)",
    )
    p.add_argument("--trace", action="store_true", help="print the dispatch trace")
    p.add_argument("--json", action="store_true", help="print everything as JSON")


MAX_NEW_TOKENS = 1 << 20
MAX_PROMPT = 1 << 20


def parse_tokens(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--tokens must be comma-separated integers, found {text!r}") from None
    if not ids:
        raise UsageError("--tokens is empty")
    if len(ids) > MAX_PROMPT:
        raise UsageError(f"--tokens holds {len(ids)} ids; at most {MAX_PROMPT}")
    if any(i < 0 for i in ids):
        raise UsageError(f"--tokens must be non-negative token ids, found {min(ids)}")
    return ids


def run(args: argparse.Namespace) -> int:
    import torch

    from qcompiler.ir.kv import causal_lm_dims
    from qcompiler.runtime import Session, load

    ids = parse_tokens(args.tokens)
    if args.max_new_tokens < 0 or args.max_new_tokens > MAX_NEW_TOKENS:
        raise UsageError(f"--max-new-tokens must be 0..{MAX_NEW_TOKENS}, found {args.max_new_tokens}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = load(args.path, device=args.device, fallback=args.fallback, compute=args.compute)
    session = Session(lm)
    causal = causal_lm_dims(lm.graph) is not None
    x = torch.tensor([ids], dtype=torch.int64)
    inputs = [x] if causal else [x, torch.ones_like(x)]
    if causal and args.max_new_tokens > 0:
        generated, steps = session.generate([ids], args.max_new_tokens)
        logits = steps[0]
    else:
        out = session.step(x) if causal else session.run(inputs)[0]
        generated, logits = [[]], out[:, -1]
    top = torch.topk(logits[0].float(), k=min(5, logits.shape[-1]))
    result: dict[str, Any] = {
        "path": args.path,
        "logits": {
            "shape": list(logits.shape),
            "argmax": int(logits[0].argmax()),
            "top5": [[int(i), float(v)] for v, i in zip(top.values, top.indices, strict=True)],
        },
        "generated": generated[0],
        "compute": lm.compute,
        "kernels": {phase: sorted(k) for phase, k in session.kernels_used.items()},
        "fallback_fraction": lm.fallback_fraction(),
        "loaded_bits_per_weight": lm.loaded_bits_per_weight(),
        "warnings": [str(w.message) for w in caught],
        "timeline_s": {k: round(v, 6) for k, v in lm.timeline.items()},
        "memory_bytes": lm.memory,
        "self_check": lm.self_check,
    }
    if args.trace or args.json:
        result["trace"] = lm.trace()
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return 0
    render(result, args.trace)
    return 0


def render(r: dict[str, Any], trace: bool) -> None:
    console = Console()
    console.print(
        f"{r['path']}: logits {r['logits']['shape']}, argmax {r['logits']['argmax']}, top-5 {r['logits']['top5']}"
    )
    if r["generated"]:
        console.print(f"generated: {','.join(map(str, r['generated']))}")
    console.print(f"compute {r['compute']}; kernels: {r['kernels']}; fallback fraction {r['fallback_fraction']:.1%}")
    for w in r["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {w}")
    console.print(f"timeline (s): {r['timeline_s']}")
    console.print(f"memory (bytes): {r['memory_bytes']}")
    if not trace:
        return
    table = Table(title="dispatch trace")
    for col in ("op", "weight", "phase", "selected", "rejected (reason)"):
        table.add_column(col)
    for d in r["trace"]:
        rejected = "; ".join(f"{c['kernel']}: {c['reason']}" for c in d["candidates"] if not c["accepted"])
        table.add_row(d["op"], d["weight"], d["phase"], f"{d['selected']} ({d['kind']})", rejected)
    console.print(table)

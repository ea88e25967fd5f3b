"""CPU greedy decode tokens/s and peak RSS: our runtime (bf16 and f32 activations) against torch eager
float32 and llama.cpp on the same weights, every row in its own process.

    python bench/decode.py [--shape bench|1.1b] [--tokens N] [--threads 2] [--verify] [--work DIR]
                           [--rows bf16 f32 eager llama.cpp] [--hidden 1024] [--layers 4]

Shapes (``--shape``):

- ``bench`` (the default): a seeded float32 Llama (``--hidden`` 1024, ``--layers`` 4, 8 heads / 4 KV
  heads, vocab 2048; ``onnx_runtime.make_model``) written into a temporary directory; ours is its
  ``w4-g32`` compressed-tensors compile; 32 tokens by default.
- ``1.1b``: the TinyLlama shape of ``bench/scale.py`` (hidden 2048, 22 layers, vocab 32000): a seeded
  random bf16 checkpoint that ``scale.checkpoint`` writes once into ``--work`` (default
  ``~/.cache/qcompiler/bench``; 2.2 GB, reused by later runs, never committed); ours is its ``w4-g128``
  compressed-tensors compile; 16 tokens by default.

The same source is also compiled ``q4_0`` to GGUF, both by ``qcompiler compile`` into a temporary
directory. Rows:

- ``qcompiler runtime (bf16 activations)``: ``qcompiler.load(CT, compute="bf16")`` + ``Session`` (KV
  cache): the packed kernels take bf16 activations (``cpu.int4pack-bf16``);
- ``qcompiler runtime (f32, exact)``: ``compute="f32"``: float32 activations, the exact numerics;
- ``torch eager float32 (transformers)``: transformers' ``LlamaForCausalLM`` loaded from the source
  in float32 (the 1.1b bf16 checkpoint upcast), with its cache;
- ``llama.cpp (q4_0 GGUF artifact)``: llama-cpp-python on the GGUF artifact.

Each row is a fresh ``sys.executable`` child (``--row``; nothing forked from a parent holding torch)
that loads its model, runs an 8-token prompt, then decodes ``--tokens`` tokens greedily at batch 1
with ``--threads`` threads (the rate excludes the prefill), and prints one JSON line: tokens/s, its own
peak RSS (``VmHWM``, load included) and, for our rows, the kernels ``lm.decisions`` selected (listed
under the table, so a fallback shows). Children's stderr is kept and shown only when one fails. The
ratio column is the bf16 runtime row / that row: ours / peer, above 1 when ours is faster.

``--verify`` also times ``qcompiler verify CT --level 5 --json`` on our artifact in a child: wall
seconds, peak RSS (``ru_maxrss`` from ``wait4``) and exit code (the goal for the 1.1b w4-g128
artifact: under 10 minutes), and its error when it fails. The script exits 1 when a compile, a row or
the verify failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import checkpoint

PROMPT = [1, 5, 17, 99, 3, 42, 7, 8]

ROWS: dict[str, str] = {
    "bf16": "qcompiler runtime (bf16 activations)",
    "f32": "qcompiler runtime (f32, exact)",
    "eager": "torch eager float32 (transformers)",
    "llama.cpp": "llama.cpp (q4_0 GGUF artifact)",
}
"""--row key -> table label; the first is the ratios' numerator."""

SHAPES: dict[str, tuple[str, int]] = {"bench": ("w4-g32", 32), "1.1b": ("w4-g128", 16)}
"""--shape -> (our scheme, default --tokens)."""

VERIFY_GOAL_S = 600.0


def peak_rss_mb() -> float:
    """This process's peak resident set (``VmHWM``) in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError("no VmHWM in /proc/self/status")


def ours(path: Path, tokens: int, compute: str) -> dict[str, Any]:
    import torch

    import qcompiler
    from qcompiler.runtime import Session

    lm = qcompiler.load(path, compute=compute)
    s = Session(lm)
    logits = s.step(torch.tensor([PROMPT]))[:, -1]
    start = time.perf_counter()
    for _ in range(tokens):
        logits = s.step(logits.argmax(-1)[:, None])[:, -1]
    rate = tokens / (time.perf_counter() - start)
    return {"tokens_s": rate, "kernels": sorted({d.selected for d in lm.decisions})}


def eager(src: Path, tokens: int) -> dict[str, Any]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([PROMPT]), use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)[:, None]
        start = time.perf_counter()
        for _ in range(tokens):
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)[:, None]
    return {"tokens_s": tokens / (time.perf_counter() - start)}


def llama_cpp(path: Path, tokens: int, threads: int) -> dict[str, Any]:
    from llama_cpp import Llama

    n_ctx = max(128, len(PROMPT) + tokens + 1)
    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, verbose=False)
    llm.eval(PROMPT)
    start = time.perf_counter()
    for _ in range(tokens):
        llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
    return {"tokens_s": tokens / (time.perf_counter() - start)}


def child(row: str, path: Path, tokens: int, threads: int) -> dict[str, Any]:
    """One row, in this (fresh) process: its result and this process's peak RSS."""
    if row == "llama.cpp":
        out = llama_cpp(path, tokens, threads)
    else:
        import torch

        torch.set_num_threads(threads)
        out = eager(path, tokens) if row == "eager" else ours(path, tokens, row)
    return {**out, "rss_mb": peak_rss_mb()}


@dataclass
class Done:
    wall_s: float
    rss_mb: float
    """The child's ``ru_maxrss`` from ``wait4``."""
    rc: int
    out: str
    err: str


def spawn(argv: list[str]) -> Done:
    """Run ``argv`` to its end with stdout and stderr kept in files (no pipe to fill while waiting)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = rc = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    return Done(wall, usage.ru_maxrss * 1024 / 1e6, rc, *text)


def tail(done: Done, n: int = 3000) -> str:
    """The ends of the child's stdout and stderr (shown when it failed)."""
    return "\n".join(x[-n:] for x in (done.out.strip(), done.err.strip()) if x)


def this(*argv: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *argv]


def qc(*argv: str) -> list[str]:
    return [sys.executable, "-m", "qcompiler.cli.main", *argv]


class Failed(Exception):
    pass


def step(console: Console, what: str, argv: list[str]) -> Done:
    with console.status(what):
        done = spawn(argv)
    if done.rc:
        console.print(f"[red]{escape(what)} failed (exit {done.rc})[/red]\n{escape(tail(done))}")
        raise Failed(what)
    console.print(f"[dim]{escape(what)}: {done.wall_s:.1f} s, peak RSS {done.rss_mb:.0f} MB[/dim]", soft_wrap=True)
    return done


def prepare(console: Console, args: argparse.Namespace, tmp: Path) -> tuple[Path, Path, Path]:
    """(source, compressed-tensors artifact, GGUF file), compiled into ``tmp``."""
    if args.shape == "1.1b":
        args.work.mkdir(parents=True, exist_ok=True)
        src = checkpoint(args.work, "1.1b")
    else:
        src = tmp / "llama"
        step(console, "writing the seeded bench model", this("--make-bench", str(src), *size_flags(args)))
    scheme = SHAPES[args.shape][0]
    for s, target, out in ((scheme, "safetensors", tmp / "ct"), ("q4_0", "gguf", tmp / "gguf")):
        argv = qc("compile", str(src), "--scheme", s, "--target", target, "-o", str(out), "--quiet")
        step(console, f"qcompiler compile --scheme {s} --target {target}", argv)
    return src, tmp / "ct", tmp / "gguf" / "model.gguf"


def size_flags(args: argparse.Namespace) -> list[str]:
    return ["--hidden", str(args.hidden), "--layers", str(args.layers)]


def run_rows(console: Console, args: argparse.Namespace, paths: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """--row key -> the child's JSON, or ``{"rc": N}`` where it failed (its stderr printed)."""
    results: dict[str, dict[str, Any]] = {}
    for row in args.rows:
        argv = this("--row", row, "--path", str(paths[row]), "--tokens", str(args.tokens))
        with console.status(f"decoding: {ROWS[row]}"):
            done = spawn([*argv, "--threads", str(args.threads)])
        line = next((x for x in reversed(done.out.splitlines()) if x.startswith("{")), None)
        if done.rc or line is None:
            console.print(f"[red]{escape(ROWS[row])} failed (exit {done.rc})[/red]\n{escape(tail(done))}")
            results[row] = {"rc": done.rc or 1}
        else:
            results[row] = json.loads(line)
    return results


def report(console: Console, args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    small = f"llama {args.hidden} x {args.layers} (float32)"
    what = "1.1b llama (2048 x 22, bf16)" if args.shape == "1.1b" else small
    scheme = SHAPES[args.shape][0]
    title = f"greedy decode, {what}, ours {scheme}, batch 1, {args.tokens} tokens, {args.threads} threads"
    table = Table(title=title)
    table.add_column("runtime", no_wrap=True)
    for col in ("tokens/s", "peak RSS MB", "bf16 / this"):
        table.add_column(col, justify="right")
    base = results.get("bf16", {}).get("tokens_s")
    for row, r in results.items():
        if "tokens_s" not in r:
            table.add_row(ROWS[row], f"failed (exit {r['rc']})", "", "")
            continue
        ratio = f"{base / r['tokens_s']:.2f}x" if base else ""
        table.add_row(ROWS[row], f"{r['tokens_s']:.1f}", f"{r['rss_mb']:.0f}", ratio)
    console.print(table)
    for row, r in results.items():
        if "kernels" in r:
            console.print(escape(f"kernels selected by {ROWS[row]}: {', '.join(r['kernels'])}"), soft_wrap=True)


def verify(console: Console, args: argparse.Namespace, ct: Path) -> bool:
    """Time ``qcompiler verify CT --level 5 --json``; print its line (and its error when it fails)."""
    with console.status("qcompiler verify --level 5 --json"):
        done = spawn(qc("verify", str(ct), "--level", "5", "--json"))
    scheme = SHAPES[args.shape][0]
    line = f"qcompiler verify --level 5 --json ({args.shape}, {scheme} compressed-tensors): {done.wall_s:.1f} s, "
    line += f"peak RSS {done.rss_mb:.0f} MB, exit {done.rc}"
    if args.shape == "1.1b":
        line += f"; goal under {VERIFY_GOAL_S:.0f} s: {'PASS' if done.wall_s < VERIFY_GOAL_S else 'FAIL'}"
    console.print(escape(line), soft_wrap=True)
    if done.rc:
        try:
            console.print(escape(f"verify error: {json.loads(done.out)['error']}"), soft_wrap=True)
        except (ValueError, KeyError, TypeError):
            console.print(escape(tail(done)))
    return not done.rc


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    p.add_argument("--hidden", type=int, default=1024, help="bench shape only")
    p.add_argument("--layers", type=int, default=4, help="bench shape only")
    p.add_argument("--tokens", type=int, help="decode steps timed (default: 32 for bench, 16 for 1.1b)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="which rows to run")
    p.add_argument("--verify", action="store_true", help="also time qcompiler verify --level 5 on our artifact")
    default_work = Path.home() / ".cache" / "qcompiler" / "bench"
    p.add_argument("--work", type=Path, default=default_work, help="where the 1.1b checkpoint is kept")
    p.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)  # a child: run one row
    p.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--make-bench", type=Path, help=argparse.SUPPRESS)  # a child: write the bench model
    args = p.parse_args()
    if args.tokens is None:
        args.tokens = SHAPES[args.shape][1]
    return args


def main() -> None:
    args = parse()
    if args.make_bench:
        from onnx_runtime import make_model

        make_model(args.make_bench, args.hidden, args.layers)
        return
    if args.row:
        print(json.dumps(child(args.row, args.path, args.tokens, args.threads)))
        return
    console = Console()
    try:
        with tempfile.TemporaryDirectory(prefix="qcompiler-decode-") as tmp:
            src, ct, gguf = prepare(console, args, Path(tmp))
            paths = {"bf16": ct, "f32": ct, "eager": src, "llama.cpp": gguf}
            results = run_rows(console, args, paths)
            report(console, args, results)
            ok = all("tokens_s" in r for r in results.values())
            if args.verify:
                ok = verify(console, args, ct) and ok
    except Failed:
        ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""Compile real-sized checkpoints: wall time, peak RSS and MB/s of ``qcompiler compile`` against
llmcompressor's RTN W4A16 oneshot on the same checkpoint, in the same run.

    python bench/scale.py --shapes 1.1b 8b --llmc ~/.cache/qcompiler-bench/llmc [--targets ct gguf onnx]

For each shape, ``bench/scale_checkpoint.py`` writes a seeded random bf16 checkpoint into ``--work``
(once: it is kept, marked complete, and never committed). Every command then runs in its own
subprocess; its peak resident set is the ``ru_maxrss`` that ``wait4`` reports for it (the kernel's
VmHWM of the process). Rows:

- ``ct``: ``qcompiler compile SRC --scheme w4-g128 --target safetensors`` (compressed-tensors);
- ``gguf``: ``--scheme q4_k_m --target gguf``; ``onnx``: ``--scheme w4-g128 --target onnx-nbits``;
- ``verify ct``: ``qcompiler verify OUT`` (every reader gate and rungs 1-3) of the ``ct`` artifact;
- ``llmcompressor``: ``oneshot(QuantizationModifier(targets="Linear", scheme="W4A16",
  ignore=["lm_head"]))`` then ``save_pretrained(save_compressed=True)``, run by the Python of the venv
  given as ``--llmc`` (llmcompressor pins its own transformers; ``--make-llmc`` creates that venv).

It prints one table (wall, peak RSS, source MB/s, ours/llmcompressor ratios) and the issue's goals
as pass/fail lines; ``--json`` writes the rows. Outputs are deleted after each row (``--keep``
keeps them). Record results in docs/performance.md with the date and machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_checkpoint import SHAPES

LLMC_RUNNER = """
import sys
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier

src, out = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
recipe = QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
oneshot(model=model, recipe=recipe)
model.save_pretrained(out, save_compressed=True)
"""

TARGETS: dict[str, tuple[str, str]] = {
    "ct": ("w4-g128", "safetensors"),
    "gguf": ("q4_k_m", "gguf"),
    "onnx": ("w4-g128", "onnx-nbits"),
}
"""row -> (--scheme, --target)."""


@dataclass
class Row:
    shape: str
    what: str
    wall_s: float
    peak_rss_mb: float
    source_mb: float
    out_mb: float
    rc: int

    @property
    def mb_per_s(self) -> float:
        return self.source_mb / self.wall_s if self.wall_s else 0.0


def run(argv: list[str], cwd: Path) -> tuple[float, float, int, str]:
    """(wall seconds, peak RSS MB, exit code, the tail of stderr) of one subprocess."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        tail = err.read().decode(errors="replace")[-2000:]
    return wall, usage.ru_maxrss / 1024, proc.returncode, tail


def size_mb(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 1e6


def checkpoint(work: Path, shape: str) -> Path:
    src = work / shape
    if not (src / ".complete").exists():
        shutil.rmtree(src, ignore_errors=True)
        print(f"writing the {shape} checkpoint into {src} ...", flush=True)
        # in a child: a child forked from a parent that held torch and the writer's buffers would
        # report the parent's resident set as its own peak (the kernel carries it across exec)
        script = Path(__file__).resolve().parent / "scale_checkpoint.py"
        subprocess.run([sys.executable, str(script), str(src), "--shape", shape], check=True)
        (src / ".complete").write_text("")
    return src


def largest_tensor_mb(shape: str) -> float:
    s = SHAPES[shape]
    h, ff, vocab = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    return max(vocab * h, ff * h) * 2 / 1e6


def rows_for(shape: str, src: Path, args: argparse.Namespace) -> list[Row]:
    work: Path = args.work
    source_mb = sum(p.stat().st_size for p in src.glob("*.safetensors")) / 1e6
    qc = [sys.executable, "-m", "qcompiler.cli.main"]
    rows: list[Row] = []

    def record(what: str, argv: list[str], out: Path) -> None:
        wall, rss, rc, tail = run(argv, work)
        rows.append(Row(shape, what, wall, rss, source_mb, size_mb(out) if out.exists() else 0.0, rc))
        print(f"  {shape} {what}: {wall:.1f} s, {rss:.0f} MB peak, rc {rc}", flush=True)
        if rc:
            print(tail, file=sys.stderr)

    for row in args.targets:
        scheme, target = TARGETS[row]
        out = work / f"out-{shape}-{row}"
        shutil.rmtree(out, ignore_errors=True)
        argv = [*qc, "compile", str(src), "--scheme", scheme, "--target", target, "-o", str(out), "--quiet"]
        record(row, [*argv, "--jobs", str(args.jobs)], out)
        if row == "ct" and out.exists():
            record("verify ct", [*qc, "verify", str(out)], out)
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    if args.llmc:
        out = work / f"out-{shape}-llmc"
        shutil.rmtree(out, ignore_errors=True)
        runner = work / "llmc_runner.py"
        runner.write_text(LLMC_RUNNER)
        record("llmcompressor", [str(Path(args.llmc) / "bin" / "python"), str(runner), str(src), str(out)], out)
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| shape | command | wall s | peak RSS MB | source MB/s | output MB | wall / llmc | RSS / llmc |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peer = next((p for p in rows if p.shape == r.shape and p.what == "llmcompressor" and not p.rc), None)
        wr = f"{r.wall_s / peer.wall_s:.2f}" if peer and r is not peer else ""
        mr = f"{r.peak_rss_mb / peer.peak_rss_mb:.2f}" if peer and r is not peer else ""
        status = "" if not r.rc else f" (exit {r.rc})"
        lines.append(
            f"| {r.shape} | {r.what}{status} | {r.wall_s:.1f} | {r.peak_rss_mb:.0f} | {r.mb_per_s:.1f} | "
            f"{r.out_mb:.0f} | {wr} | {mr} |"
        )
    return "\n".join(lines)


def goals(rows: list[Row]) -> list[str]:
    def get(shape: str, what: str) -> Row | None:
        return next((r for r in rows if r.shape == shape and r.what == what and not r.rc), None)

    out: list[str] = []
    ct, peer = get("1.1b", "ct"), get("1.1b", "llmcompressor")
    if ct and peer:
        ratio = ct.wall_s / peer.wall_s
        out.append(f"1.1b ct wall <= 1.0x llmcompressor: {ratio:.2f}x {'PASS' if ratio <= 1.0 else 'FAIL'}")
    if ct:
        ok = ct.peak_rss_mb <= 1500
        out.append(f"1.1b ct peak RSS <= 1500 MB: {ct.peak_rss_mb:.0f} MB {'PASS' if ok else 'FAIL'}")
    bound = 3 * largest_tensor_mb("8b") + 1000
    for what in ("ct", "gguf", "onnx", "verify ct"):
        r = get("8b", what)
        if r:
            ok = r.peak_rss_mb <= bound
            out.append(f"8b {what} peak RSS <= {bound:.0f} MB: {r.peak_rss_mb:.0f} MB {'PASS' if ok else 'FAIL'}")
    small, big = get("1.1b", "ct"), get("8b", "ct")
    if small and big:
        allowed = 1.2 * (largest_tensor_mb("8b") - largest_tensor_mb("1.1b"))
        grew = big.peak_rss_mb - small.peak_rss_mb
        out.append(f"8b - 1.1b ct peak <= {allowed:.0f} MB: {grew:.0f} MB {'PASS' if grew <= allowed else 'FAIL'}")
    return out


def make_llmc(path: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "llmcompressor==0.14.*", "torch==2.13.0"], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["1.1b"])
    ap.add_argument("--targets", nargs="*", choices=sorted(TARGETS), default=sorted(TARGETS))
    ap.add_argument("--llmc", help="a venv with llmcompressor 0.14 (skip its row when absent)")
    ap.add_argument("--make-llmc", action="store_true", help="create the --llmc venv first")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "qcompiler-bench" / "scale")
    ap.add_argument("--jobs", type=int, default=0, help="qcompiler --jobs (0: all cores)")
    ap.add_argument("--keep", action="store_true", help="keep the outputs")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.make_llmc and args.llmc and not Path(args.llmc, "bin", "python").exists():
        make_llmc(Path(args.llmc))
    rows: list[Row] = []
    for shape in args.shapes:
        rows += rows_for(shape, checkpoint(args.work, shape), args)
    print(f"\n{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores\n")
    print(table(rows))
    for line in goals(rows):
        print(line)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"mb_per_s": r.mb_per_s} for r in rows], indent=2))


if __name__ == "__main__":
    main()

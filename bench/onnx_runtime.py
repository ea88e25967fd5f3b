"""onnxruntime latency of our ONNX artifacts against the fp32 export of the same model, batch 1 and 32.

A Llama-shaped model (``--hidden`` 1024, ``--layers`` 4, intermediate 2816, 8 heads / 4 KV heads, vocab
2048, float32, seeded) is saved as a transformers directory and compiled by ``qcompiler compile`` four
ways: fp32 (no ``--scheme``: dense ``MatMul``), and ``w4-g32`` as ``onnx-nbits`` at accuracy level 1 and 4
and as ``onnx-qdq`` at level 4 (onnxruntime fuses it into MatMulNBits). Every variant runs in its own
process (so its peak RSS is its own; the worker imports onnxruntime and numpy only), on the same
``input_ids``, with ``--threads`` intra-op threads: session creation time, then the median of
``--repeat`` runs of ``model.onnx`` (the KV-cache decoder graph) at (batch, sequence) = (1, 1) and
(32, 1), decode steps after a cache of ``--seq`` positions, and (1, ``--seq``), a prefill on an empty
cache. Ratios are fp32 time / variant time (above 1: the quantized artifact is faster).

Then the onnxruntime-genai rows (``genai_decode.compare``, skipped with ``--no-genai``): greedy decode
tokens/s through ``og.Model(DIR)`` of our w4-g32 artifact (attention decomposed, and
``--onnx-attention gqa``) against genai's own model builder output (int4 MatMulNBits) for the same
float model, at accuracy level 4, ratios printed.

    python bench/onnx_runtime.py [--hidden 1024] [--layers 4] [--seq 32] [--repeat 10] [--threads 2] [--no-genai]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

VARIANTS: tuple[tuple[str, list[str], int], ...] = (
    ("fp32", ["--target", "onnx"], 1),
    ("w4-g32 nbits acc1", ["--scheme", "w4-g32", "--target", "onnx-nbits", "--accuracy-level", "1"], 1),
    ("w4-g32 nbits acc4", ["--scheme", "w4-g32", "--target", "onnx-nbits", "--accuracy-level", "4"], 4),
    ("w4-g32 qdq acc4", ["--scheme", "w4-g32", "--target", "onnx-qdq", "--accuracy-level", "4"], 4),
)


def peak_rss_mib() -> float:
    """This process's peak RSS (``VmHWM``: unlike ``ru_maxrss``, it does not inherit the parent's peak at fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def SHAPES(seq: int) -> tuple[tuple[int, int], ...]:
    return ((1, 1), (32, 1), (1, seq))


def make_model(path: Path, hidden: int, layers: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)


def feed(sess: Any, ids: np.ndarray, past: int) -> dict[str, np.ndarray]:
    """The decoder graph's inputs for ``ids`` after ``past`` cached positions (zeros: the timing is the
    same); ``qcompiler.backends.onnx.feeds`` does this for real decoding, but imports torch."""
    batch, length = ids.shape
    out = {"input_ids": ids, "attention_mask": np.ones((batch, past + length), np.int64)}
    out["position_ids"] = np.broadcast_to(np.arange(past, past + length, dtype=np.int64), ids.shape).copy()
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values."):
            out[i.name] = np.zeros((batch, i.shape[1], past, i.shape[3]), np.float32)
    return out


def worker(model: str, accuracy: int, seq: int, repeat: int, threads: int) -> dict[str, Any]:
    import onnxruntime as ort

    so = ort.SessionOptions()  # what qcompiler.backends.onnx.dispatch.session_options sets, without importing torch
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy))
    so.intra_op_num_threads = threads
    start = time.perf_counter()
    sess = ort.InferenceSession(model, sess_options=so, providers=["CPUExecutionProvider"])
    out: dict[str, Any] = {"create_s": time.perf_counter() - start}
    for batch, length in SHAPES(seq):
        ids = np.random.default_rng(batch).integers(0, 2048, (batch, length))
        inputs = feed(sess, ids, seq if length == 1 else 0)
        sess.run(None, inputs)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            sess.run(None, inputs)
            times.append(time.perf_counter() - t0)
        out[f"{batch}x{length}"] = 1e3 * float(np.median(times))
    out["rss_mib"] = peak_rss_mib()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-genai", action="store_true", help="skip the onnxruntime-genai rows")
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "ACCURACY"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.seq, args.repeat, args.threads)))
        return
    console = Console()
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "llama"
        make_model(src, args.hidden, args.layers)
        for label, flags, accuracy in VARIANTS:
            out = Path(tmp) / label.replace(" ", "_")
            with console.status(f"compiling {label}"):
                cmd = [sys.executable, "-m", "qcompiler.cli.main", "compile", str(src), "-o", str(out), *flags]
                subprocess.run(cmd, check=True, capture_output=True)
            size = sum(f.stat().st_size for f in out.iterdir() if f.name.startswith("model.onnx"))
            with console.status(f"running {label}"):
                cmd = [sys.executable, __file__, "--worker", str(out / "model.onnx"), str(accuracy)]
                cmd += ["--seq", str(args.seq), "--repeat", str(args.repeat), "--threads", str(args.threads)]
                done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            rows[label] = {**json.loads(done.stdout.strip().splitlines()[-1]), "mib": size / 2**20}
    base = rows["fp32"]
    table = Table(title=f"llama hidden {args.hidden} x {args.layers} layers, {args.threads} threads; ms (fp32 / ours)")
    shapes = [f"{b}x{s}" for b, s in SHAPES(args.seq)]
    table.add_column("variant", no_wrap=True)
    for col in ("model MiB", "create s", *shapes, "peak RSS MiB"):
        table.add_column(col, justify="right")
    for label, r in rows.items():
        timings = [f"{r[s]:.2f} ({base[s] / r[s]:.2f}x)" for s in shapes]
        table.add_row(label, f"{r['mib']:.1f}", f"{r['create_s']:.2f}", *timings, f"{r['rss_mib']:.0f}")
    console.print(table)
    if not args.no_genai:
        from genai_decode import compare

        compare(args.hidden, args.layers, args.seq, 64, 5, 4)


if __name__ == "__main__":
    main()

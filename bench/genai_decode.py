"""onnxruntime-genai greedy decode of our ONNX artifact against genai's own model builder output for
the same float model, int4 ``MatMulNBits`` in both.

The model is ``onnx_runtime.py``'s seeded Llama (``--hidden`` 1024, ``--layers`` 4 by default), saved
with a word-level tokenizer (genai's builder will not run without one). Three directories are made:

- ours: ``qcompiler compile SRC --scheme w4-g32 --target onnx-nbits --accuracy-level A``, loaded by
  ``og.Model(DIR)`` as it is (its ``genai_config.json`` is the artifact's own), attention decomposed;
- ours gqa: the same with ``--onnx-attention gqa`` (one ``GroupQueryAttention`` a layer, genai's
  shared past/present buffers);
- genai's: ``python -m onnxruntime_genai.models.builder -i SRC -o DIR -p int4 -e cpu --extra_options
  accuracy_level=A block_size=32`` (its graph fuses q/k/v into one MatMulNBits and attention into
  ``GroupQueryAttention``, and it quantizes ``lm_head`` too, which our ``w4-g32`` keeps float).

Each directory is run in its own process: a ``--prompt``-token prompt (prefill), then ``--tokens``
greedy steps, ``--repeat`` times; reported are the median prefill milliseconds and decode tokens per
second, and the ratios of each of ours to genai's (above 1: ours is faster).

    python bench/genai_decode.py [--hidden 1024] [--layers 4] [--prompt 32] [--tokens 64] [--accuracy 4]
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from onnx_runtime import make_model, peak_rss_mib

VOCAB = 2048


def make_source(path: Path, hidden: int, layers: int) -> None:
    """``onnx_runtime.make_model``'s Llama plus a word-level tokenizer over its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    make_model(path, hidden, layers)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)


OURS = {"ours": (), "ours gqa": ("--onnx-attention", "gqa")}
"""Our rows -> the compile flags beyond the scheme, target and accuracy level."""
THEIRS = "genai builder"


def build(kind: str, src: Path, out: Path, accuracy: int) -> None:
    if kind in OURS:
        cmd = [sys.executable, "-m", "qcompiler.cli.main", "compile", str(src), "-o", str(out)]
        cmd += ["--scheme", "w4-g32", "--target", "onnx-nbits", "--accuracy-level", str(accuracy), *OURS[kind]]
    else:
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(out)]
        cmd += ["-p", "int4", "-e", "cpu", "--extra_options", f"accuracy_level={accuracy}", "block_size=32"]
    subprocess.run(cmd, check=True, capture_output=True)


def worker(path: str, prompt: int, tokens: int, repeat: int) -> dict[str, Any]:
    og: Any = importlib.import_module("onnxruntime_genai")  # a native module pyright cannot see into
    t0 = time.perf_counter()
    model = og.Model(path)
    load_s = time.perf_counter() - t0
    ids = np.random.default_rng(0).integers(3, VOCAB, prompt).astype(np.int32)
    prefill, decode, seq = [], [], []
    for _ in range(repeat + 1):  # the first run warms the session up and is not counted
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=prompt + tokens, min_length=prompt + tokens, do_sample=False)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(ids)
        t1 = time.perf_counter()
        steps = 0
        while not gen.is_done():
            gen.generate_next_token()
            steps += 1
        t2 = time.perf_counter()
        prefill.append(t1 - t0)
        decode.append(steps / (t2 - t1))
        seq = [int(t) for t in gen.get_sequence(0)][prompt:]
    return {
        "load_s": load_s,
        "prefill_ms": 1e3 * float(np.median(prefill[1:])),
        "tokens_per_s": float(np.median(decode[1:])),
        "generated": len(seq),
        "rss_mib": peak_rss_mib(),
    }


def compare(hidden: int, layers: int, prompt: int, tokens: int, repeat: int, accuracy: int) -> None:
    """Build the three directories, decode each in its own process, print the table and the ratios
    (``bench/onnx_runtime.py`` prints these rows after its own)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "llama"
        make_source(src, hidden, layers)
        for kind in (*OURS, THEIRS):
            out = Path(tmp) / kind.replace(" ", "_")
            with console.status(f"building {kind}"):
                build(kind, src, out, accuracy)
            with console.status(f"decoding with {kind}"):
                cmd = [sys.executable, __file__, "--worker", str(out), "--prompt", str(prompt)]
                cmd += ["--tokens", str(tokens), "--repeat", str(repeat)]
                done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            rows[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    theirs = rows[THEIRS]
    title = f"onnxruntime-genai greedy decode, llama hidden {hidden} x {layers}, int4 acc {accuracy}"
    table = Table(title=title)
    for col in ("artifact", "load s", f"prefill {prompt} ms", "decode tok/s", "peak RSS MiB"):
        table.add_column(col, justify="right" if col != "artifact" else "left")
    for kind, r in rows.items():
        cells = (f"{r['load_s']:.2f}", f"{r['prefill_ms']:.1f}", f"{r['tokens_per_s']:.1f}", f"{r['rss_mib']:.0f}")
        table.add_row(kind, *cells)
    console.print(table)
    for kind in OURS:
        ours = rows[kind]
        console.print(f"decode tokens/s, {kind} / {THEIRS}: {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}")
        console.print(f"prefill, {THEIRS} ms / {kind} ms: {theirs['prefill_ms'] / ours['prefill_ms']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--accuracy", type=int, default=4)
    p.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.prompt, args.tokens, args.repeat)))
        return
    compare(args.hidden, args.layers, args.prompt, args.tokens, args.repeat, args.accuracy)


if __name__ == "__main__":
    main()

"""CPU greedy decode tokens/s: our runtime against torch eager float and llama.cpp, on one seeded model.

A seeded Llama (``--hidden`` 1024, ``--layers`` 4, vocab 2048, float32) is compiled twice from the same
floats: ``w4-g32`` to compressed-tensors (run by ``qcompiler.load`` + ``Session``: ``cpu.int4pack``
kernels, KV cache) and ``q4_0`` to GGUF (run by llama.cpp through llama-cpp-python). torch eager is
transformers' own ``LlamaForCausalLM`` in float32 with its cache. Each decodes ``--tokens`` tokens
greedily after an 8-token prompt at batch 1 with ``--threads`` threads; the rate excludes the prefill.
Ratios are ours / peer (above 1: ours is faster).

    python bench/decode.py [--hidden 1024] [--layers 4] [--tokens 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

PROMPT = [1, 5, 17, 99, 3, 42, 7, 8]


def ours(path: Path, tokens: int) -> float:
    import torch

    import qcompiler
    from qcompiler.runtime import Session

    s = Session(qcompiler.load(path))
    logits = s.step(torch.tensor([PROMPT]))[:, -1]
    start = time.perf_counter()
    for _ in range(tokens):
        logits = s.step(logits.argmax(-1)[:, None])[:, -1]
    return tokens / (time.perf_counter() - start)


def eager(src: Path, tokens: int) -> float:
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
    return tokens / (time.perf_counter() - start)


def llama_cpp(path: Path, tokens: int, threads: int) -> float:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=128, n_threads=threads, verbose=False)
    llm.eval(PROMPT)
    start = time.perf_counter()
    for _ in range(tokens):
        llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
    return tokens / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    import torch

    from qcompiler.testing import run_cli

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).parent))
    from onnx_runtime import make_model

    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "llama"
        make_model(src, args.hidden, args.layers)
        for scheme, target in (("w4-g32", "safetensors"), ("q4_0", "gguf")):
            with console.status(f"compiling {scheme} -> {target}"):
                r = run_cli("compile", str(src), "--scheme", scheme, "--target", target, "-o", f"{tmp}/{target}")
                assert r.code == 0, r.err
        rates = {
            "qcompiler runtime (w4-g32, cpu.int4pack)": ours(Path(tmp) / "safetensors", args.tokens),
            "torch eager float32 (transformers)": eager(src, args.tokens),
            "llama.cpp (q4_0 GGUF artifact)": llama_cpp(Path(tmp) / "gguf" / "model.gguf", args.tokens, args.threads),
        }
    base = next(iter(rates.values()))
    table = Table(title=f"greedy decode, llama hidden {args.hidden} x {args.layers}, batch 1, {args.threads} threads")
    for col in ("runtime", "tokens/s", "ours / this"):
        table.add_column(col, justify="right")
    for name, rate in rates.items():
        table.add_row(name, f"{rate:.1f}", f"{base / rate:.2f}x")
    console.print(table)


if __name__ == "__main__":
    main()

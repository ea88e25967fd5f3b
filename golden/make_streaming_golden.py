"""Regenerate ``golden/streaming/hashes.json``: the sha256 of the container files ``qcompiler compile``
writes for ``tiny_llama_hf`` (float32, seeded) saved as an HF directory, for each target below.

    python golden/make_streaming_golden.py

The values were first written by the compiler before it streamed (it loaded the whole model, commit
a062215) and the streaming compiler writes the same bytes; ``tests/test_streaming.py`` holds every
later compiler to them, for ``--jobs 1`` and ``--jobs 2``. Three changes since, all to ``model.onnx``
only: it took new node names when the weightless capture stopped re-tracing its functional graph
(the same 193 nodes, ops, attributes and initializers; only FX's names such as ``mul_76`` became
``mul``), it became the KV-cache decoder graph (attention mask, position ids, past/present
key-values) that onnxruntime-genai and optimum open, and it took new node names again when the
capture began numbering values itself (``frontend/names.py``: the same 184 nodes, ops, attributes and
wiring; a name FX's tracer skipped to, such as ``mul_17`` after ``mul_8``, is now the next number,
``mul_9``); ``model.onnx.data`` (every weight) kept its bytes.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent / "streaming"

CASES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "safetensors": ("w4-g32", "safetensors", ("model.safetensors",)),
    "gguf": ("q4_0", "gguf", ("model.gguf",)),
    "onnx-nbits": ("w4-g32", "onnx-nbits", ("model.onnx", "model.onnx.data")),
}
"""case -> (scheme, target, files hashed)."""


def save_source(dest: Path) -> Path:
    from qcompiler.examples import tiny_llama_hf

    tiny_llama_hf().save_pretrained(dest)  # pyright: ignore[reportCallIssue]
    return dest


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    out: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = save_source(Path(tmp) / "src")
        for case, (scheme, target, files) in CASES.items():
            art = Path(tmp) / case
            cmd = [sys.executable, "-m", "qcompiler.cli.main", "compile", str(src), "--scheme", scheme]
            r = subprocess.run([*cmd, "--target", target, "-o", str(art)], capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"{case}: compile failed\n{r.stderr}")
            out[case] = {f: sha256(art / f) for f in files}
    HERE.mkdir(exist_ok=True)
    (HERE / "hashes.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()

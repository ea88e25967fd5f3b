"""A pre-quantized checkpoint is streamed, not held: compiling a compressed-tensors W4A16 checkpoint
(written by compressed-tensors' own compressor) keeps one layer's codes at a time, so the same model
at 2 and at 8 layers differs in peak RSS by less than 25% (a ratio, not a time), and every stored
tensor still comes back byte for byte. (Holding the model, as the compiler did before it streamed
these sources, took about twice the checkpoint's size at 1.1B parameters.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from test_streaming import peak_rss_mb

ROOT = Path(__file__).resolve().parents[1]
MAKE = """
import sys
sys.path[:0] = [sys.argv[1] + "/tests", sys.argv[1] + "/bench"]
import torch, transformers
from prequant_packers import ct_checkpoint
from scale_checkpoint import SHAPES

layers = int(sys.argv[3])
torch.manual_seed(layers)
config = transformers.LlamaConfig(**{**SHAPES["small"], "num_hidden_layers": layers})
model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
w4_g128 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
ct_checkpoint(sys.argv[2], "pack-quantized", w4_g128, model=model)
"""
"""``bench/scale_checkpoint.py``'s ``small`` shape at a given depth, random bf16 weights, quantized by
compressed-tensors: in a child, so that the compile's peak (``wait4``) is not this process's, forked."""


def test_a_prequantized_checkpoint_streams(tmp_path: Path) -> None:
    peaks = {}
    for layers in (2, 8):
        src = tmp_path / f"ct{layers}"
        subprocess.run([sys.executable, "-c", MAKE, str(ROOT), str(src), str(layers)], check=True, capture_output=True)
        out = tmp_path / f"out{layers}"
        cmd = [sys.executable, "-m", "qcompiler.cli.main", "compile", str(src), "--target", "safetensors"]
        peaks[layers] = peak_rss_mb([*cmd, "-o", str(out), "--quiet", "-j", "2"], tmp_path)
        stored, emitted = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
        assert sorted(stored) == sorted(emitted)
        for name, t in stored.items():
            assert emitted[name].dtype == t.dtype, name
            assert torch.equal(emitted[name].view(torch.uint8), t.view(torch.uint8)), name
    assert peaks[8] / peaks[2] < 1.25, peaks

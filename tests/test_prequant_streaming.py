"""A pre-quantized checkpoint is streamed, not held (``rebuilt.Filler`` with a fake mode): the model
handed to the export holds no weight (every parameter and checkpoint buffer fake; the codes in the
blob store as recipes that read their layer again; dense tensors referenced where they lie), and
compiling a compressed-tensors W4A16 checkpoint (written by compressed-tensors' own compressor) of
the same model at 2 and at 8 layers differs in peak RSS by less than 25% (a ratio, not a time),
every stored tensor coming back byte for byte."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from prequant_packers import ct_checkpoint
from safetensors.torch import load_file
from test_streaming import peak_rss_mb

from qcompiler.backends.safetensors.prequant_formats import load_ct
from qcompiler.frontend.skeleton import is_fake
from qcompiler.ir.blobs import read_blob, spilled
from qcompiler.ir.core import TensorDecl

ROOT = Path(__file__).resolve().parents[1]
W4_G32 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
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


def test_the_loaded_model_holds_no_weight(tmp_path: Path) -> None:
    """Every parameter and checkpoint buffer of the model handed to the export is fake; the codes
    are in the blob store, under the names the lowering binds, and read back as the layer's."""
    src = tmp_path / "ct"
    ct_checkpoint(src, "pack-quantized", W4_G32)
    with spilled(tmp_path / "spill"):
        cap = load_ct(str(src))
        held = [n for n, t in [*cap.module.named_parameters(), *cap.module.named_buffers()] if not is_fake(t)]
        assert held == []
        assert cap.lazy is not None
        codes = cap.lazy["model.layers.0.mlp.down_proj.weight.codes"]
        assert codes.location == "mem"
        again = read_blob(TensorDecl("codes", codes))  # the recipe reads the layer again, checked by sha256
        assert len(again) == codes.nbytes
        assert "model.embed_tokens.weight" in cap.lazy
        assert cap.lazy["model.embed_tokens.weight"].location.startswith("safetensors:")


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

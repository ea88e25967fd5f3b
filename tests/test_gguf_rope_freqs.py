"""Llama 3's scaled RoPE (``rope_type`` ``llama3``) through the gguf target: llama.cpp's
``rope_freqs.weight``, derived from the captured graph's ``inv_freq`` (``backends/gguf/rope_freqs.py``).

A tiny Llama whose slow frequencies are scaled within 24 tokens (head 16, rope_theta 500000, factor 8,
original context 64): llama.cpp's F32 logits are transformers', the factors are the ones llama.cpp's
converter computes from config.json, and the same weights with plain RoPE are far from llama.cpp's
logits (so a dropped table would fail). The table is bound: edited, the artifact is refused naming it;
a ``.gguf`` holding one is refused as a SOURCE."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from prequant_packers import artifact_decodes, llama_cpp_logits, logits, rel_l2

from qcompiler.artifact.reader import ArtifactError
from qcompiler.backends.gguf.read import open_gguf_dir
from qcompiler.testing import run_cli

ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CONFIG: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}
PEAKED = {"initializer_range": 0.2}
"""Larger weights: peaked attention, so positions (and how they rotate) matter to the logits."""


def llama(rope: dict[str, Any], **over: Any) -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**CONFIG, **over}, rope_parameters=rope)
    return transformers.LlamaForCausalLM(cfg).eval()


def converter_factors(rope: dict[str, Any], dim: int) -> np.ndarray:
    """llama.cpp's converter's factors for ``llama3``, from config.json (not from the graph)."""
    old, low, high, factor = (rope[k] for k in ("original_max_position_embeddings", "low_freq_factor",
                                                "high_freq_factor", "factor"))  # fmt: skip
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def compile_ok(*args: str) -> None:
    r = run_cli("compile", *args, "--quiet")
    assert r.code == 0, r.err


def test_llama3_rope_runs_in_llama_cpp_as_in_transformers(tmp_path: Path) -> None:
    model = llama(ROPE, **PEAKED)
    src, f32, q4 = tmp_path / "src", tmp_path / "f32", tmp_path / "q4_0"
    model.save_pretrained(src)
    compile_ok(str(src), "--target", "gguf", "-o", str(f32))
    tensors = {t.name: t for t in gguf.GGUFReader(str(f32 / "model.gguf")).tensors}
    factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64)
    want = converter_factors(ROPE, 16)
    assert want[0] == 1.0
    assert 1.0 < want[1] < 8.0
    assert want[-1] == 8.0
    assert np.allclose(factors, want, rtol=1e-5, atol=0), (factors, want)
    theirs = llama_cpp_logits(f32)
    rel = rel_l2(theirs, logits(model))
    plain = rel_l2(theirs, logits(llama({"rope_type": "default", "rope_theta": 500000.0}, **PEAKED)))
    print(f"llama3 rope F32: llama.cpp vs transformers rel-L2 {rel:.2e}; vs the same weights, plain RoPE {plain:.2e}")
    assert rel <= 2e-3
    assert plain > 1e-2
    model = llama(ROPE)  # default weights: llama.cpp's Q8_0 activations err less on smaller ones
    model.save_pretrained(src)
    compile_ok(str(src), "--scheme", "q4_0", "--target", "gguf", "-o", str(q4))
    for name, values in artifact_decodes(q4).items():
        model.get_parameter(name).data = torch.from_numpy(values.astype(np.float32))
    rel = rel_l2(llama_cpp_logits(q4), logits(model))
    print(f"llama3 rope Q4_0: llama.cpp vs the artifact's decode rel-L2 {rel:.2e}")
    assert rel <= 1e-2
    for art in (f32, q4):
        r = run_cli("verify", str(art))
        assert r.code == 0, r.err


def test_the_factor_table_is_bound_and_not_importable(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    llama(ROPE).save_pretrained(src)
    compile_ok(str(src), "--target", "gguf", "-o", str(out))
    r = run_cli("compile", str(out / "model.gguf"), "--target", "gguf", "-o", str(tmp_path / "again"), "--quiet")
    assert r.code == 1
    assert "Traceback" not in r.err
    assert "rope_freqs.weight: tensor: RoPE frequency factors (Llama 3's scaled RoPE) are not importable" in r.err
    t = next(t for t in gguf.GGUFReader(str(out / "model.gguf")).tensors if t.name == "rope_freqs.weight")
    at = int(t.data_offset) + 4 * 3  # the fourth factor: 8 to float32 rounding
    clean = (out / "model.gguf").read_bytes()
    eight = np.frombuffer(clean[at : at + 4], "<f4")[0]
    assert abs(eight - 8.0) < 1e-5
    cases = {
        np.float32(4.0): "llama.rope.freq_base: disagrees with what graph.qir computes (inv_freq) (expected "
        "inv_freq[i] = 500000.0 ** (-2i / 16) / rope_freqs.weight[i], found 500000.0)",
        np.nextafter(eight, np.float32(0)): "tensor rope_freqs.weight",  # within the rope check's ulps: the record
    }
    for value, words in cases.items():
        blob = bytearray(clean)
        blob[at : at + 4] = np.float32(value).tobytes()
        (out / "model.gguf").write_bytes(bytes(blob))
        with pytest.raises(ArtifactError) as e:
            open_gguf_dir(out, None)  # the gguf reader's own gates (the manifest's sha256 would refuse it first)
        assert words in str(e.value), str(e.value)

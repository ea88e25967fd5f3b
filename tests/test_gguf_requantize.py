"""A float ``.gguf`` compiled with ``--scheme`` is quantized as it streams (``frontend/requantize.py``):
the model handed to the export holds no weight, a BF16 file's dtype is kept (dense tensors, scales and
the config's ``dtype``, as the same model compiled from its HF directory), transformers +
compressed-tensors load the result, the bytes are the same for any ``--jobs``, and a tie the scheme
does not share falls back to the in-memory quantizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from qcompiler.artifact.reader import open_artifact
from qcompiler.ir.interpret import run_graph
from qcompiler.testing import run_cli

BF16 = "qcompiler.examples:tiny_llama_bf16_hf"  # hidden 64, untied, bfloat16
WIDE = "qcompiler.examples:tiny_llama_wide_hf"  # hidden 256, tied embeddings, float32
UNTIED = "qcompiler.examples:tiny_llama_wide_untied_hf"


def compile_ok(*args: str) -> None:
    r = run_cli("compile", *args)
    assert r.code == 0, r.err


def frontend(out: Path) -> str:
    return str(json.loads((out / "manifest.json").read_text())["provenance"]["ir"]["frontend"])


@pytest.fixture(scope="module")
def bf16_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bf16") / "g"
    compile_ok(BF16, "--target", "gguf", "-o", str(out))
    return out / "model.gguf"


def test_the_quantized_model_holds_no_weight(tmp_path: Path, bf16_gguf: Path) -> None:
    """Every parameter and buffer of the model ``capture_source`` exported is fake; rung 3's float
    weights are read from the file when asked, in its dtype, rows in transformers' order."""
    from qcompiler.api import capture_source
    from qcompiler.backends.gguf.reader import open_gguf
    from qcompiler.frontend.skeleton import is_fake
    from qcompiler.ir.blobs import spilled

    with spilled(tmp_path / "spill"):
        captured = capture_source(str(bf16_gguf), scheme="w4-g32", scales="source")
        assert captured.model is not None
        tensors = [*captured.model.named_parameters(), *captured.model.named_buffers()]
        assert [n for n, t in tensors if not is_fake(t)] == []
        assert str(captured.module.attrs["provenance"]["frontend"]).startswith("streamed")  # type: ignore[index]
        up = captured.float_weights["model.layers.0.mlp.up_proj.weight"]  # ffn rows are not permuted
        stored = np.asarray(open_gguf(bf16_gguf).array("blk.0.ffn_up.weight"))
        assert up.dtype == torch.bfloat16
        assert up.view(torch.int16).numpy().view(np.uint16).tobytes() == stored.tobytes()
        assert "model.layers.0.mlp.up_proj.weight" not in captured.module.tensors


def test_a_bf16_gguf_keeps_its_dtype_in_compressed_tensors(tmp_path: Path, bf16_gguf: Path) -> None:
    """BF16 dense tensors and scales, ``dtype: bfloat16`` in config.json: every tensor but the norms
    (F32 in a GGUF file) equals the same model compiled from its HF checkpoint; transformers loads it
    with no missing or unexpected key and computes our reference graph's logits."""
    import transformers
    from safetensors.torch import load_file

    from qcompiler.examples import tiny_llama_bf16_hf

    hf, ours, direct = tmp_path / "hf", tmp_path / "ours", tmp_path / "direct"
    model: Any = tiny_llama_bf16_hf()
    model.save_pretrained(hf)
    compile_ok(str(bf16_gguf), "--scheme", "w4-g32", "--target", "safetensors", "-o", str(ours))
    compile_ok(str(hf), "--scheme", "w4-g32", "--target", "safetensors", "-o", str(direct))
    assert frontend(ours).startswith("streamed")
    assert json.loads((ours / "config.json").read_text())["dtype"] == "bfloat16"
    a, b = load_file(ours / "model.safetensors"), load_file(direct / "model.safetensors")
    assert sorted(a) == sorted(b)
    assert a["model.layers.0.mlp.up_proj.weight_scale"].dtype == torch.bfloat16
    assert a["model.embed_tokens.weight"].dtype == torch.bfloat16
    differ = sorted(k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]))
    assert differ
    assert all(k.endswith("norm.weight") and a[k].dtype == torch.float32 for k in differ), differ
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
        ours, local_files_only=True, output_loading_info=True, dtype=torch.float32
    )
    back, info = loaded
    assert (set(info["missing_keys"]), set(info["unexpected_keys"])) == (set(), set())
    ids = torch.tensor([[int(i) for i in np.random.default_rng(4).integers(0, 128, 16)]])
    with torch.no_grad():
        theirs = back.eval()(input_ids=ids).logits[0].double().numpy()
    ref = run_graph(open_artifact(ours).module, [ids])[0][0].double().numpy()
    assert float(np.abs(theirs - ref).max()) <= 1e-5 * float(np.abs(ref).max())


def test_the_bytes_are_the_same_for_any_jobs(tmp_path: Path) -> None:
    """An F32 file requantized to llama.cpp's q4_k_m with one worker and with two: the same file."""
    f32, one, two = tmp_path / "f32", tmp_path / "one", tmp_path / "two"
    compile_ok(UNTIED, "--target", "gguf", "-o", str(f32))
    compile_ok(str(f32 / "model.gguf"), "--scheme", "q4_k_m", "--target", "gguf", "--jobs", "1", "-o", str(one))
    compile_ok(str(f32 / "model.gguf"), "--scheme", "q4_k_m", "--target", "gguf", "--jobs", "2", "-o", str(two))
    assert frontend(one).startswith("streamed")
    assert (one / "model.gguf").read_bytes() == (two / "model.gguf").read_bytes()


def test_a_tie_the_scheme_does_not_share_is_quantized_in_memory(tmp_path: Path) -> None:
    """``--embeddings`` quantizes a tied table but not the head the built-in quantizer excludes: only
    the in-memory quantizer keeps that float head, so the source is read whole (and says so). A
    mixture's tied table is quantized once and streamed (``test_gguf_source`` compares it with
    llama.cpp's own file)."""
    f32, emb, mix = tmp_path / "f32", tmp_path / "emb", tmp_path / "mix"
    compile_ok(WIDE, "--target", "gguf", "-o", str(f32))
    compile_ok(str(f32 / "model.gguf"), "--scheme", "q8_0", "--embeddings", "--target", "gguf", "-o", str(emb))
    assert frontend(emb).startswith("in memory")
    assert run_cli("verify", str(emb)).code == 0
    compile_ok(str(f32 / "model.gguf"), "--scheme", "q4_k_m", "--target", "gguf", "-o", str(mix))
    assert frontend(mix).startswith("streamed")


@pytest.mark.parametrize(("scheme", "target"), [("w4-g32", "safetensors"), ("q4_k_m", "gguf")])
def test_the_export_runs_in_a_child_beside_the_quantization(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheme: str, target: str
) -> None:
    """The planned modules' stand-ins (and a mixture's tied twin) are swapped in before any weight is
    read, a forked child exports the model while this process quantizes (``api.capture_beside``), and
    its module is used: the same artifact as the export in this process, after the quantization."""
    from qcompiler import api

    f32, here, beside = tmp_path / "f32", tmp_path / "here", tmp_path / "beside"
    compile_ok(WIDE, "--target", "gguf", "-o", str(f32))
    args = [str(f32 / "model.gguf"), "--scheme", scheme, "--target", target, "--jobs", "2"]
    with monkeypatch.context() as mp:
        mp.setattr(api, "available", lambda: False)
        compile_ok(*args, "-o", str(here))
    captured_here: list[object] = []
    real = api.capture
    monkeypatch.setattr(api, "capture", lambda *a, **k: captured_here.append(a) or real(*a, **k))  # pyright: ignore[reportUnknownLambdaType]
    compile_ok(*args, "-o", str(beside))
    assert captured_here == []
    assert frontend(beside).startswith("streamed")
    for name in sorted(p.name for p in here.iterdir() if p.name != "manifest.json"):
        assert (here / name).read_bytes() == (beside / name).read_bytes(), name

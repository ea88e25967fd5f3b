"""Decoder families beside Llama through every target: Qwen2 (q/k/v biases, tied embeddings), Qwen3
(q/k RMS norms, its own head size, tied embeddings) and Mistral (llama's graph in llama.cpp).

Tiny random models saved by ``save_pretrained``. GGUF: the float compile run by llama.cpp gives
transformers' logits; a ``q4_0`` compile run by llama.cpp gives the logits of the model whose
Linear weights are the artifact's own decode; ``verify`` passes; and the ``.gguf`` read back as a
SOURCE re-emits the same file byte for byte. safetensors (transformers' dequantizing load),
onnx-nbits (onnxruntime) and triton (``verify``: the graph probe and the kernels' AOT build): a
``w4-g32`` compile gives the logits of the model with the artifact's own decode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from prequant_packers import artifact_decodes

from qcompiler.backends.gguf.reader import open_gguf
from qcompiler.errors import QcError
from qcompiler.testing import run_cli

IDS = [1, 5, 9, 33, 2, 7, 100, 4]
COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
FAMILIES: dict[str, tuple[str, Any]] = {
    "qwen2": ("qwen2", lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON))),
    "qwen3": ("qwen3", lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=32))),
    "mistral": (
        "llama",
        lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=None)),
    ),
}


def llama_cpp_logits(path: Path) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path / "model.gguf"), logits_all=True, n_ctx=64, verbose=False)
    llm.eval(IDS)
    return np.array(llm.scores[: len(IDS)], dtype=np.float64)


def logits(model: Any) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([IDS])).logits[0].double().numpy()


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_llama_cpp_runs_the_family(family: str, tmp_path: Path) -> None:
    arch, make = FAMILIES[family]
    torch.manual_seed(0)
    model = make().eval()
    src = tmp_path / family
    model.save_pretrained(src)
    out = tmp_path / "f32"
    r = run_cli("compile", str(src), "--target", "gguf", "-o", str(out), "--quiet")
    assert r.code == 0, r.err
    assert open_gguf(out / "model.gguf").metadata["general.architecture"][1] == arch
    assert rel_l2(llama_cpp_logits(out), logits(model)) < 2e-3
    q4 = tmp_path / "q4_0"
    r = run_cli("compile", str(src), "--scheme", "q4_0", "--target", "gguf", "-o", str(q4), "--quiet")
    assert r.code == 0, r.err
    decoded = artifact_decodes(q4)
    assert decoded
    for name, values in decoded.items():
        model.get_parameter(name).data = torch.from_numpy(values.astype(np.float32))
    assert rel_l2(llama_cpp_logits(q4), logits(model)) < 1e-2
    assert run_cli("verify", str(q4)).code == 0
    again = tmp_path / "again"
    r = run_cli("compile", str(q4 / "model.gguf"), "--target", "gguf", "-o", str(again), "--quiet")
    assert r.code == 0, r.err
    assert (again / "model.gguf").read_bytes() == (q4 / "model.gguf").read_bytes()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_family_through_safetensors_onnx_and_triton(family: str, tmp_path: Path) -> None:
    import onnxruntime as ort

    torch.manual_seed(0)
    model = FAMILIES[family][1]().eval()
    src = tmp_path / family
    model.save_pretrained(src)
    outs = {t: tmp_path / t for t in ("safetensors", "onnx-nbits", "triton")}
    for target, out in outs.items():
        r = run_cli("compile", str(src), "--scheme", "w4-g32", "--target", target, "-o", str(out), "--quiet")
        assert r.code == 0, (target, r.err)
        assert run_cli("verify", str(out)).code == 0, target
    for name, values in artifact_decodes(outs["safetensors"]).items():
        model.get_parameter(name).data = torch.from_numpy(values.astype(np.float32))
    want = logits(model)
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
        outs["safetensors"],
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
        dtype=torch.float32,
        output_loading_info=True,
    )
    back, info = loaded
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    assert rel_l2(logits(back.eval()), want) < 1e-5
    sess = ort.InferenceSession(str(outs["onnx-nbits"] / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    feeds = {names[0]: np.array([IDS], dtype=np.int64)}
    if "attention_mask" in names:
        feeds["attention_mask"] = np.ones((1, len(IDS)), dtype=np.int64)
    assert rel_l2(np.asarray(sess.run(None, feeds)[0])[0].astype(np.float64), want) < 1e-3


def test_capture_takes_a_transformers_model_as_users_call_it() -> None:
    """``qcompiler.capture(model, (input_ids,))`` on a causal LM with its default ``use_cache=True``
    (the README's snippet): the cache is off while it is exported, and on again after."""
    import qcompiler

    torch.manual_seed(0)
    model = FAMILIES["qwen2"][1]().eval()
    assert model.config.use_cache
    m = qcompiler.capture(
        qcompiler.quantize(model, "w4-g32"), (torch.tensor([IDS]),), dynamic={"input_ids": {1: "seq"}}
    )
    ret = m.graphs[0].ops[-1]
    assert [str(v.type) for v in ret.operands] == ["tensor<f32[1,?seq,256]>"]
    assert model.config.use_cache


def test_a_sliding_window_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """Mistral with ``sliding_window`` shorter than its context: QIR has no windowed mask and the
    export of a short example traces a plain causal one, so every graph target would attend past the
    window (llama.cpp's and onnxruntime's logits drifted to 0.25 rel-L2 at 40 tokens with a window of
    16). Refused naming config.json's field, from the directory and from ``qcompiler.capture``."""
    import qcompiler

    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=16)).eval()
    src = tmp_path / "swa"
    model.save_pretrained(src)
    for target in ("safetensors", "gguf"):
        out = tmp_path / target
        r = run_cli("compile", str(src), "--target", target, "-o", str(out), "--quiet")
        assert r.code == 1, r.err
        assert "Traceback" not in r.err
        for word in ("config.json", "sliding_window", "found 16", "max_position_embeddings (128)"):
            assert word in r.err, r.err
        assert not out.exists()
    model.config.use_cache = False
    with pytest.raises(QcError, match="sliding_window=16"):
        qcompiler.capture(model, (torch.tensor([IDS]),))


def test_gguf_refuses_what_it_cannot_write_before_the_capture(tmp_path: Path) -> None:
    """An architecture llama.cpp has no graph for (OPT) and Llama 3.1's ``llama3`` RoPE scaling
    (llama.cpp needs ``rope_freqs`` factors this target does not write) are refused from config.json
    before anything is captured; the float graph targets still take the Llama."""
    torch.manual_seed(0)
    opt = transformers.OPTConfig(
        vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=1, num_attention_heads=4, word_embed_proj_dim=64
    )
    transformers.OPTForCausalLM(opt).save_pretrained(tmp_path / "opt")
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling: dict[str, Any] = {"rope_scaling": {**rope, "original_max_position_embeddings": 64}}
    cfg = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 1024}, **scaling)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama3")
    cases = {"opt": ["Qwen2ForCausalLM", "OPTForCausalLM"], "llama3": ["RoPE scaling 'llama3'", "rope_freqs"]}
    for name, words in cases.items():
        out = tmp_path / f"{name}-gguf"
        r = run_cli("compile", str(tmp_path / name), "--target", "gguf", "-o", str(out), "--quiet")
        assert r.code == 1, r.err
        assert "Traceback" not in r.err
        for word in words:
            assert word in r.err, r.err
        assert not out.exists()
    out = tmp_path / "llama3-st"
    assert run_cli("compile", str(tmp_path / "llama3"), "--target", "safetensors", "-o", str(out), "--quiet").code == 0

"""FP8 (compressed-tensors ``float-quantized``) checkpoints as sources.

The checkpoints are written by compressed-tensors' own compressor (what llmcompressor calls to save)
from min-max FP8 scales: per channel with llmcompressor's ``FP8_DYNAMIC`` activation scheme
(dynamic per-token FP8 activations), per tensor and per group of 32, weight only. The reference is
the float model whose Linear weights are the checkpoint's decode ``float32(w_fp8) * scale``, read
with torch's own float8 type. Into compressed-tensors every stored tensor comes back byte for byte
and transformers' dequantizing load gives the reference's logits. Into Triton the codes are kept:
a kernel specialised on float8 codes turns each byte into its E4M3FN value from its bit fields,
checked on Triton's CPU interpreter. Into GGUF and ONNX an FP8 weight is a conversion (no ggml
block or MatMulNBits holds float8 codes): refused, or with ``--allow-conversion`` stored decoded in
float32, measured (exact) and run by llama.cpp and onnxruntime."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from prequant_packers import (
    IDS,
    assert_decodes_equal_reference,
    compile_to,
    ct_checkpoint,
    logits,
    made_once,
    rel_l2,
    tiny_llama,
)
from safetensors.torch import load_file, save_file

from qcompiler.backends.onnx.feeds import prefill_feed
from qcompiler.testing import run_cli

DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}


def write_fp8(out: Path, strategy: str, group: int | None = None, activations: bool = False, seed: int = 0) -> Any:
    """An FP8 checkpoint of a tiny bf16 Llama written by compressed-tensors' compressor; returns the
    reference model (each quantized weight set to ``float32(fp8) * scale``)."""
    w = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "group_size": group}
    ct_checkpoint(out, "float-quantized", w, DYNAMIC_TOKEN if activations else None, seed)
    return fp8_reference(out, tiny_llama(seed, torch.bfloat16).float())


def fp8_reference(path: Path, model: Any) -> Any:
    tensors = load_file(str(path / "model.safetensors"))
    for name, mod in model.named_modules():
        if f"{name}.weight_scale" not in tensors:
            continue
        values, s = tensors[f"{name}.weight"].float(), tensors[f"{name}.weight_scale"].float()
        size = values.shape[1] // s.shape[-1] if s.dim() == 2 else values.shape[1]
        mod.weight.data = values * (s.reshape(1, 1) if s.numel() == 1 else s.repeat_interleave(size, 1))
    return model.eval()


SOURCES: dict[str, Callable[[Path], Any]] = {
    "fp8-dynamic-channel": lambda p: write_fp8(p, "channel", activations=True),
    "fp8-tensor": lambda p: write_fp8(p, "tensor"),
    "fp8-group32": lambda p: write_fp8(p, "group", 32),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    return made_once(tmp_path_factory, SOURCES)


def without(qc: dict[str, Any], *keys: str) -> dict[str, Any]:
    """The config with ``keys`` dropped at the top and in each group's ``weights``."""
    out = {k: v for k, v in qc.items() if k not in keys}
    out["config_groups"] = {
        name: {**g, "weights": {k: v for k, v in g["weights"].items() if k not in keys}}
        for name, g in qc["config_groups"].items()
    }
    return out


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_fp8_reemits_byte_identical_and_transformers_loads_it(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, name: str
) -> None:
    """FP8 -> compressed-tensors: no conversion, every stored tensor byte for byte (the F8_E4M3
    weights, the bf16 scales), the same quantization config (the dynamic activation scheme written
    back), every weight's decode bit for bit the checkpoint's, and transformers' dequantizing load
    with no missing or unexpected keys gives the reference's logits."""
    src, ref = source(name)
    out = tmp_path / "ct"
    r = compile_to(src, "safetensors", out)
    assert r.code == 0, r.err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["conversions"] == []
    before, after = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(before) == set(after)
    for key, t in before.items():
        assert (t.dtype, t.shape) == (after[key].dtype, after[key].shape), key
        assert torch.equal(t.reshape(-1).view(torch.uint8), after[key].reshape(-1).view(torch.uint8)), key
    assert any(t.dtype == torch.float8_e4m3fn for t in after.values())
    qc_in = json.loads((src / "config.json").read_text())["quantization_config"]
    qc_out = json.loads((out / "config.json").read_text())["quantization_config"]
    keep = ("version", "actorder", "global_compression_ratio", "moe_sparsity_config")
    assert without(qc_out, *keep) == without(qc_in, *keep)
    assert_decodes_equal_reference(out, ref)
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
        out,
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
        dtype=torch.float32,
        output_loading_info=True,
    )
    model, info = loaded
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    # compressed-tensors decodes in the scales' dtype (bf16, one rounding), the reference in float32
    assert rel_l2(logits(model.eval()), logits(ref)) < 5e-3
    shown = json.loads(run_cli("inspect", str(out), "--json").out)
    assert "f8e4m3" in json.dumps(shown)


def test_fp8_into_gguf_and_onnx_is_a_measured_conversion(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path
) -> None:
    """No ggml block and no MatMulNBits holds float8 codes: refused naming the weight and the
    family; with ``--allow-conversion`` each weight is stored decoded (float32, error 0 recorded)
    and llama.cpp and onnxruntime give the reference's logits. (onnxruntime's CPU provider has no FP8
    MatMul: a ``DequantizeLinear`` of FLOAT8E4M3FN codes would be folded into a dense f32 weight, the
    silent fallback the dispatch proof refuses.)"""
    import onnxruntime as ort
    from llama_cpp import Llama

    src, ref = source("fp8-dynamic-channel")
    for target in ("gguf", "onnx-nbits"):
        r = compile_to(src, target, tmp_path / f"no-{target}")
        assert r.code == 1, r.err
        assert "f8e4m3" in r.err, r.err
        assert "--allow-conversion" in r.err, r.err
        assert not (tmp_path / f"no-{target}").exists()
    out = tmp_path / "gguf"
    assert compile_to(src, "gguf", out, "--allow-conversion").code == 0
    records = json.loads((out / "manifest.json").read_text())["conversions"]
    assert records
    assert {c["kind"] for c in records} == {"dense"}
    assert all(c["max_abs_err"] == 0.0 for c in records)
    llm = Llama(model_path=str(out / "model.gguf"), logits_all=True, n_ctx=64, verbose=False)
    llm.eval(IDS)
    # llama.cpp multiplies the bf16 embedding and head with bf16 activations: about 2e-3 here
    assert rel_l2(np.array(llm.scores[: len(IDS)], dtype=np.float64), logits(ref)) < 1e-2
    out = tmp_path / "onnx"
    assert compile_to(src, "onnx-nbits", out, "--allow-conversion").code == 0
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    got = np.asarray(sess.run(None, prefill_feed(sess, np.array([IDS], dtype=np.int64)))[0])[0]
    assert rel_l2(got.astype(np.float64), logits(ref)) < 1e-3


def broken(src: Path, tmp_path: Path, cfg_edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    if cfg_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg_edit(cfg["quantization_config"]["config_groups"]["group_0"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def static_activations(g: dict[str, Any]) -> None:
    g["input_activations"] = {**DYNAMIC_TOKEN, "dynamic": False, "strategy": "tensor"}


def block_strategy(g: dict[str, Any]) -> None:
    g["weights"].update({"strategy": "block", "block_structure": [128, 128]})


def int_activations(g: dict[str, Any]) -> None:
    g["input_activations"] = {**DYNAMIC_TOKEN, "type": "int"}


REFUSED = {
    "static-activations": (static_activations, ["input_activations.dynamic", "input_scale"]),
    "block": (block_strategy, ["weights.block_structure", "block strategy"]),
    "int-activations": (int_activations, ["input_activations.type", "FP8"]),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_fp8_schemes_not_read_are_refused_by_field(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, case: str
) -> None:
    """Static activation scales (``input_scale`` tensors), block-wise FP8 scales and integer
    activations: a typed refusal naming the config field, nothing written."""
    src, _ = source("fp8-dynamic-channel")
    edit, words = REFUSED[case]
    r = compile_to(broken(src, tmp_path, edit), "safetensors", tmp_path / "o")
    assert r.code == 1, r.err
    assert "Traceback" not in r.err
    for w in words:
        assert w in r.err, r.err
    assert not (tmp_path / "o").exists()


def test_a_nan_fp8_code_is_refused_naming_the_tensor(source: Callable[[str], tuple[Path, Any]], tmp_path: Path) -> None:
    """No weight is NaN: an E4M3 NaN pattern (0x7f) in a stored weight is a typed error naming the
    file, the tensor and the element, before anything is written."""
    src, _ = source("fp8-tensor")
    dst = broken(src, tmp_path)
    tensors = load_file(str(dst / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    raw = tensors[name].view(torch.uint8).clone()
    raw[3, 5] = 0x7F
    tensors[name] = raw.view(torch.float8_e4m3fn)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    r = compile_to(dst, "safetensors", tmp_path / "o")
    assert r.code == 1, r.err
    assert "Traceback" not in r.err
    for w in (name, "NaN", "[3, 5]", "model.safetensors"):
        assert w in r.err, r.err
    assert not (tmp_path / "o").exists()


def test_the_e4m3fn_table_is_torchs_float8_for_every_pattern() -> None:
    """``minifloat.E4M3FN`` (computed from the fields) equals torch's ``float8_e4m3fn`` for all 256
    bit patterns, NaN exactly at 0x7f and 0xff; the reference decoder multiplies once in float32."""
    from qcompiler.ir.dtypes import DTYPES
    from qcompiler.ir.minifloat import E4M3FN
    from qcompiler.ir.reference import decode
    from qcompiler.ir.types import DenseType
    from qcompiler.quant.describe import describe

    codes = torch.arange(256, dtype=torch.uint8)
    theirs = codes.view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(np.isnan(E4M3FN), np.isnan(theirs))
    assert [i for i in range(256) if np.isnan(E4M3FN[i])] == [0x7F, 0xFF]
    finite = ~np.isnan(theirs)
    assert np.array_equal(E4M3FN[finite].view(np.uint32), theirs[finite].view(np.uint32))
    rng = np.random.default_rng(0)
    q = rng.choice(np.flatnonzero(finite), size=(8, 64)).astype(np.uint8)
    scale = rng.random((8, 2), dtype=np.float32)
    d = describe("w", q, scale, None, [1, 32], 0, 255, DenseType(DTYPES["f32"], (8, 64)), "linear", family="f8e4m3")
    want = torch.from_numpy(q).view(torch.float8_e4m3fn).float() * torch.from_numpy(scale).repeat_interleave(32, 1)
    assert np.array_equal(decode(d.type, d.arrays).view(np.uint32), want.numpy().view(np.uint32))


@pytest.mark.parametrize("name", ["fp8-dynamic-channel", "fp8-group32"])
def test_triton_keeps_fp8_codes(source: Callable[[str], tuple[Path, Any]], tmp_path: Path, name: str) -> None:
    """FP8 -> triton: no conversion, every weight decodes to the checkpoint's own decode, a float8
    kernel per scheme, and ``verify`` passes (kernels regenerated byte for byte, built for sm_80/90)."""
    src, ref = source(name)
    out = tmp_path / "triton"
    r = compile_to(src, "triton", out)
    assert r.code == 0, r.err
    assert json.loads((out / "manifest.json").read_text())["conversions"] == []
    assert_decodes_equal_reference(out, ref)
    index = json.loads((out / "kernels" / "index.json").read_text())
    assert "f8e4m3" in json.dumps(index)
    assert run_cli("verify", str(out)).code == 0


@pytest.mark.parametrize("group", [0, 32])
def test_the_float8_kernel_on_the_interpreter(group: int) -> None:
    """The generated float8 kernels (decode at M = 1 and 5, prefill) on Triton's CPU interpreter,
    with every finite E4M3FN pattern (subnormals, both zeros, negatives) among the codes, against
    the float64 product with the reference decode (f32 scales: the interpreter has no bf16)."""
    from qcompiler.backends.triton.codegen import KernelKey
    from qcompiler.backends.triton.layouts import pack_kn
    from qcompiler.backends.triton.parity import kernel_parity
    from qcompiler.ir.minifloat import E4M3FN

    rng = np.random.default_rng(group)
    n, k = 48, 64
    finite = np.flatnonzero(~np.isnan(E4M3FN)).astype(np.uint8)
    q = np.concatenate([finite, rng.choice(finite, size=n * k - finite.size)]).reshape(n, k)
    size = group or k
    scale = rng.random((n, k // size), dtype=np.float32) + 0.5
    decoded = (E4M3FN[q] * np.repeat(scale, size, 1)).astype(np.float32)
    key = KernelKey("linear", 8, False, group, False, False, "f32", "f32", "f32", False, float8=True)
    checks = kernel_parity(key, pack_kn(q, 8, 0), scale, None, None, decoded)
    assert len(checks) == 3
    for c in checks:
        assert c.rel_kernel < 1e-6, c

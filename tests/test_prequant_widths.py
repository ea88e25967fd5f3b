"""GPTQ 3-bit sources and the header checks every pre-quantized source passes before it is read.

AutoGPTQ and GPTQModel (``gptq``, ``gptq_v2``) pack 32 three-bit values in 3 int32 words, along K for
``qweight`` and along N for ``qzeros``: one LSB-first bit stream per block, so value 10 is bits 30-31
of word 0 and bit 0 of word 1, and value 21 bit 31 of word 1 and bits 0-1 of word 2. The checkpoints
here are written by an independent packer that builds each block as one Python integer; the
reference is the float model whose Linear weights are the packer's own decode."""

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
    AWQ_PACK_ORDER,
    IDS,
    assert_decodes_equal_reference,
    compile_to,
    logits,
    made_once,
    rel_l2,
    rtn_unsigned,
    tiny_llama,
)
from safetensors.torch import load_file, save_file

from qcompiler.artifact.reader import open_artifact
from qcompiler.backends.safetensors import gptq_awq

LAST = "model.layers.1.mlp.down_proj"
"""The quantized Linear read last (its parameters come last)."""


def pack_stream(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned [C, M] -> int32 [C*bits/32, M], packed along C: each block of 32 values of a column
    is one integer (value j at bit 3j, LSB first), cut into ``bits`` 32-bit words."""
    c, m = values.shape
    out = np.zeros((c * bits // 32, m), dtype=np.uint32)
    for block in range(c // 32):
        for col in range(m):
            stream = 0
            for j in range(32):
                stream |= (int(values[block * 32 + j, col]) & ((1 << bits) - 1)) << (bits * j)
            for w in range(bits):
                out[block * bits + w, col] = (stream >> (32 * w)) & 0xFFFFFFFF
    return out.view(np.int32)


"""AWQ gemm: nibble ``i`` of a word holds output channel ``8w + AWQ_PACK_ORDER[i]``."""


def awq_interleave(values: np.ndarray) -> np.ndarray:
    """[R, N] -> [R, N] with column ``8w + i`` holding channel ``8w + AWQ_PACK_ORDER[i]``."""
    r, n = values.shape
    return values.reshape(r, n // 8, 8)[..., AWQ_PACK_ORDER].reshape(r, n)


def write_gptq(out: Path, kind: str, bits: int, group: int, sym: bool) -> Any:
    """A GPTQ (``gptq`` = v1: qzeros store z - 1; ``gptq_v2``) or AWQ gemm (``awq``) checkpoint of a
    tiny Llama packed by ``pack_stream``; returns the float model whose Linear weights are its
    published decode."""
    model = tiny_llama()
    tensors = {name: p.detach().clone().contiguous() for name, p in model.state_dict().items()}
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name == "lm_head":
            continue
        w = mod.weight.detach().float().numpy()
        q, z, s = rtn_unsigned(w, bits, group, sym)
        del tensors[f"{name}.weight"]
        if kind == "awq":  # both packed along N, in AWQ's channel order
            tensors[f"{name}.qweight"] = torch.from_numpy(pack_stream(awq_interleave(q.T).T, bits).T.copy())
            tensors[f"{name}.qzeros"] = torch.from_numpy(pack_stream(awq_interleave(z.T).T, bits).T.copy())
        else:
            stored_z = z.T - 1 if kind == "gptq" else z.T
            tensors[f"{name}.qweight"] = torch.from_numpy(pack_stream(q.T, bits))
            tensors[f"{name}.qzeros"] = torch.from_numpy(pack_stream(stored_z.T, bits).T.copy())
            tensors[f"{name}.g_idx"] = torch.arange(w.shape[1], dtype=torch.int32) // group
        tensors[f"{name}.scales"] = torch.from_numpy(s.T.copy())
        dec = s.astype(np.float32).repeat(group, 1) * (q - z.repeat(group, 1)).astype(np.float32)
        mod.weight.data = torch.from_numpy(dec)
    model.config.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update({"torch_dtype": "float16", "architectures": ["LlamaForCausalLM"]})
    cfg.pop("dtype", None)
    cfg["quantization_config"] = (
        {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
        if kind == "awq"
        else {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group,
            "sym": sym,
            "desc_act": False,
            "checkpoint_format": kind,
        }
    )
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return model.float()


SOURCES: dict[str, Callable[[Path], Any]] = {
    "gptq-v1-asym-3b-g32": lambda p: write_gptq(p, "gptq", 3, 32, False),
    "gptq-v2-sym-3b-g64": lambda p: write_gptq(p, "gptq_v2", 3, 64, True),
    "awq-gemm-4b-g32": lambda p: write_gptq(p, "awq", 4, 32, False),
}
THREE_BIT = ["gptq-v1-asym-3b-g32", "gptq-v2-sym-3b-g64"]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    return made_once(tmp_path_factory, SOURCES)


def test_three_bit_fields_straddle_words_as_published() -> None:
    """Values 10 and 21 of a block cross word boundaries; every value reads back from its bits."""
    one = np.zeros((32, 1), dtype=np.int64)
    one[10] = 0b111
    assert pack_stream(one, 3).view(np.uint32)[:, 0].tolist() == [0b11 << 30, 0b1, 0]
    one[10], one[21] = 0, 0b111
    assert pack_stream(one, 3).view(np.uint32)[:, 0].tolist() == [0, 1 << 31, 0b11]
    values = np.random.default_rng(1).integers(0, 8, (96, 5))
    assert np.array_equal(gptq_awq.fields(pack_stream(values, 3), 3, 0), values)
    assert np.array_equal(gptq_awq.fields(np.ascontiguousarray(pack_stream(values, 3).T), 3, 1), values.T)


@pytest.mark.parametrize("name", THREE_BIT)
def test_three_bit_gptq_compiles_to_compressed_tensors_as_stored(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, name: str
) -> None:
    """3-bit GPTQ -> compressed-tensors pack-quantized, its codes densely packed at 3 bits: no
    conversion, every weight decodes to the packer's decode bit for bit, and transformers' dequantizing
    load (compressed-tensors' decompressor) gives the reference's logits."""
    src, reference = source(name)
    out = tmp_path / "ct"
    r = compile_to(src, "safetensors", out)
    assert r.code == 0, r.err
    assert json.loads((out / "manifest.json").read_text())["conversions"] == []
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["num_bits"] == 3
    assert tuple(load_file(str(out / "model.safetensors"))[f"{LAST}.weight_packed"].shape) == (128, 256 * 3 // 32)
    assert_decodes_equal_reference(out, reference)
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
        out,
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
        dtype=torch.float32,
        output_loading_info=True,
    )
    model, info = loaded
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    assert rel_l2(logits(model.eval()), logits(reference)) < 5e-3


REASONS = {
    "triton": "the kernels read 2, 4 or 8-bit codes, not 3",
    "gguf": "no ggml block holds affine i3 codes",
    "onnx": "nbits stores 2/4/8-bit codes, not 3",
}


@pytest.mark.parametrize("name", THREE_BIT)
@pytest.mark.parametrize("target", sorted(REASONS))
def test_targets_without_three_bit_codes_refuse_then_store_them_dense(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, name: str, target: str
) -> None:
    """Triton's kernels, ggml's blocks and MatMulNBits hold no 3-bit affine codes: refused, naming the
    reason and the flag; with ``--allow-conversion`` each weight is stored dense, measured exact (the
    decode itself, no rounding) and recorded; Triton's graph gives the reference's logits."""
    src, reference = source(name)
    r = compile_to(src, target, tmp_path / "no")
    assert r.code == 1, r.err
    for words in (REASONS[target], "--allow-conversion", "model.layers.0.self_attn.q_proj.weight"):
        assert words in r.err, r.err
    assert not (tmp_path / "no").exists()
    out = tmp_path / "yes"
    r = compile_to(src, target, out, "--allow-conversion")
    assert r.code == 0, r.err
    records = json.loads((out / "manifest.json").read_text())["conversions"]
    assert len(records) == 14  # every quantized Linear of the two layers
    assert {(c["kind"], c["reason"], c["max_abs_err"], c["rel_l2"]) for c in records} == {
        ("dense", REASONS[target], 0.0, 0.0)
    }
    if target == "triton":
        from qcompiler.ir.interpret import run_graph

        got = run_graph(open_artifact(out).module, [torch.tensor([IDS])])[0][0].double().numpy()
        assert rel_l2(got, logits(reference)) < 1e-4


Tensors = dict[str, torch.Tensor]


def as_ct(src: Path, out: Path, fmt: str) -> Path:
    """``src`` compiled to compressed-tensors (pack-quantized), then, for ``int-quantized``, its codes
    and zero points rewritten unpacked as int8 tensors, with the config saying so: a source of that
    format."""
    from qcompiler.backends.safetensors.layouts import unpack_dim0, unpack_rows

    assert compile_to(src, "safetensors", out).code == 0
    if fmt == "pack-quantized":
        return out
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    qc["format"] = qc["config_groups"]["group_0"]["format"] = fmt
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(out / "model.safetensors"))
    bits = qc["config_groups"]["group_0"]["weights"]["num_bits"]
    for name in [t.removesuffix(".weight_packed") for t in tensors if t.endswith(".weight_packed")]:
        n, k = (int(v) for v in tensors.pop(f"{name}.weight_shape"))
        codes = unpack_rows(tensors.pop(f"{name}.weight_packed").numpy(), bits, n, k)
        tensors[f"{name}.weight"] = torch.from_numpy(codes)
        zero = unpack_dim0(tensors[f"{name}.weight_zero_point"].numpy(), bits, n)
        tensors[f"{name}.weight_zero_point"] = torch.from_numpy(np.ascontiguousarray(zero, dtype=np.int8))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def edited(src: Path, dst: Path, tensor: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors[tensor] = edit(tensors[tensor]).contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def shorter(t: torch.Tensor) -> torch.Tensor:
    """One word (or group, or row) less along the last axis."""
    return t[..., :-1].clone()


def to(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.to(dtype)


BROKEN_HEADERS: dict[str, tuple[str, str, str, Callable[[torch.Tensor], torch.Tensor], str]] = {
    # case: (source, format, suffix of LAST, edit, the message's word)
    "gptq-v1-qzeros-shape": ("gptq-v1-asym-3b-g32", "", "qzeros", shorter, "shape"),
    "gptq-v1-qzeros-dtype": ("gptq-v1-asym-3b-g32", "", "qzeros", to(torch.int64), "dtype"),
    "gptq-v1-scales-shape": ("gptq-v1-asym-3b-g32", "", "scales", shorter, "shape"),
    "gptq-v1-scales-dtype": ("gptq-v1-asym-3b-g32", "", "scales", to(torch.float64), "dtype"),
    "gptq-v2-qweight-shape": ("gptq-v2-sym-3b-g64", "", "qweight", shorter, "shape"),
    "gptq-v2-g_idx-dtype": ("gptq-v2-sym-3b-g64", "", "g_idx", to(torch.float32), "dtype"),
    "awq-qzeros-shape": ("awq-gemm-4b-g32", "", "qzeros", shorter, "shape"),
    "awq-scales-dtype": ("awq-gemm-4b-g32", "", "scales", to(torch.int32), "dtype"),
    "ct-pack-zero-shape": ("gptq-v1-asym-3b-g32", "pack-quantized", "weight_zero_point", shorter, "shape"),
    "ct-pack-scale-dtype": ("gptq-v1-asym-3b-g32", "pack-quantized", "weight_scale", to(torch.int16), "dtype"),
    "ct-pack-packed-shape": ("gptq-v1-asym-3b-g32", "pack-quantized", "weight_packed", shorter, "shape"),
    "ct-int-weight-dtype": ("gptq-v1-asym-3b-g32", "int-quantized", "weight", to(torch.int16), "dtype"),
    "ct-int-scale-shape": ("gptq-v1-asym-3b-g32", "int-quantized", "weight_scale", shorter, "shape"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_HEADERS))
def test_a_broken_header_is_refused_before_any_tensor_is_read(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """A quantized part of the wrong shape or dtype, in the layer read last, is refused from the
    safetensors headers alone: the message names the tensor and the field, and not one tensor was
    read (``prequant.as_numpy`` reads every one, dense or quantized)."""
    from qcompiler.backends.safetensors import prequant

    name, fmt, suffix, edit, word = BROKEN_HEADERS[case]
    src = source(name)[0]
    if fmt:
        src = as_ct(src, tmp_path / "ct", fmt)
    broken = edited(src, tmp_path / "broken", f"{LAST}.{suffix}", edit)
    reads: list[str] = []
    real = prequant.as_numpy

    def counted(f: Any, tensor: str) -> np.ndarray:
        reads.append(tensor)
        return real(f, tensor)

    monkeypatch.setattr(prequant, "as_numpy", counted)
    r = compile_to(broken, "safetensors", tmp_path / "o")
    assert r.code == 1, r.err
    assert "Traceback" not in r.err
    for w in (f"{LAST}.{suffix}", word, str(broken / "model.safetensors")):
        assert w in r.err, r.err
    assert reads == []
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fmt", ["pack-quantized", "int-quantized"])
def test_three_bit_compressed_tensors_sources_pass_their_header_checks(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, fmt: str
) -> None:
    """The unbroken compressed-tensors sources of the cases above compile, decoding as the GPTQ
    checkpoint they came from."""
    src, reference = source("gptq-v1-asym-3b-g32")
    ct = as_ct(src, tmp_path / "ct", fmt)
    r = compile_to(ct, "safetensors", tmp_path / "again")
    assert r.code == 0, r.err
    assert_decodes_equal_reference(tmp_path / "again", reference)

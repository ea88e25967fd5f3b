"""Pre-quantized checkpoints as sources: GPTQ (v1, v2), AWQ gemm and compressed-tensors directories are
read as stored (never decompressed by a library, never requantized) and transcoded.

The GPTQ/AWQ checkpoints are written by an independent packer following the published layouts
(``prequant_packers.py``); the compressed-tensors ones by compressed-tensors' own compressor. The
reference of each is the float model whose Linear weights are the checkpoint's exact decode, from
the packer's own values (GPTQ/AWQ) or from compressed-tensors' own unpacker. Each artifact is run by
the target's peer: transformers (compressed-tensors' decompressor), llama.cpp, onnxruntime."""

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
    ct_checkpoint,
    logits,
    made_once,
    pack_cols,
    pack_gptq_qweight,
    rel_l2,
    rtn_unsigned,
    tiny_llama,
)
from safetensors.torch import load_file, save_file

from qcompiler.artifact.reader import open_artifact
from qcompiler.backends.onnx.feeds import prefill_feed
from qcompiler.testing import run_cli


def write_quantized(
    out: Path, kind: str, bits: int, group: int, sym: bool, config_file: bool = False, pow2: bool = False
) -> Any:
    """A GPTQ (kind gptq = v1, gptq_v2) or AWQ (awq) checkpoint of a tiny Llama; returns the float
    model whose Linear weights are the checkpoint's published decode (the reference)."""
    model = tiny_llama()
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        tensors[name] = p.detach().clone().contiguous()
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name == "lm_head":
            continue
        w = mod.weight.detach().float().numpy()
        _n, k = w.shape
        q, z, s = rtn_unsigned(w, bits, group, sym, pow2)
        del tensors[f"{name}.weight"]
        if kind == "awq":
            tensors[f"{name}.qweight"] = torch.from_numpy(pack_cols(q.T.copy(), bits, AWQ_PACK_ORDER))
            tensors[f"{name}.qzeros"] = torch.from_numpy(pack_cols(z.T.copy(), bits, AWQ_PACK_ORDER))
        else:
            stored_z = z.T - 1 if kind == "gptq" else z.T
            tensors[f"{name}.qweight"] = torch.from_numpy(pack_gptq_qweight(q.T.copy(), bits))
            tensors[f"{name}.qzeros"] = torch.from_numpy(pack_cols(stored_z.copy(), bits))
            tensors[f"{name}.g_idx"] = torch.arange(k, dtype=torch.int32) // group
        tensors[f"{name}.scales"] = torch.from_numpy(s.T.copy())
        dec = s.astype(np.float32).repeat(group, 1) * (q - z.repeat(group, 1)).astype(np.float32)
        mod.weight.data = torch.from_numpy(dec).to(torch.float32)
    model.config.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "float16"
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg.pop("dtype", None)
    if kind == "awq":
        qc = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    else:
        qc = {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group,
            "sym": sym,
            "desc_act": False,
            "checkpoint_format": "gptq" if kind == "gptq" else "gptq_v2",
        }
    if config_file:
        (out / ("quant_config.json" if kind == "awq" else "quantize_config.json")).write_text(json.dumps(qc))
    else:
        cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return model.float()


def write_compressed_tensors(out: Path, fmt: str, bits: int, group: int | None, sym: bool, seed: int = 0) -> Any:
    """A compressed-tensors checkpoint written by compressed-tensors' own compressor (what
    llmcompressor calls to save) from round-to-nearest qparams; returns the float model whose Linear
    weights are the checkpoint's exact decode ``(q - z) * s`` (the reference)."""
    strategy = "channel" if group is None else "group"
    w = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy, "group_size": group}
    ct_checkpoint(out, fmt, w, None, seed)
    return ct_reference(out, tiny_llama(seed, torch.bfloat16).float())


def ct_reference(path: Path, model: Any) -> Any:
    """``model`` with each quantized Linear's weight set to the checkpoint's decode, read back with
    compressed-tensors' own unpacker: ``(q - z) * s`` in float32 (exact)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    wargs = cfg["config_groups"]["group_0"]["weights"]
    bits = wargs["num_bits"]
    tensors = load_file(str(path / "model.safetensors"))
    for name, mod in model.named_modules():
        if f"{name}.weight_scale" not in tensors:
            continue
        n, k = mod.weight.shape
        if f"{name}.weight_packed" in tensors:
            q = unpack_from_int32(tensors[f"{name}.weight_packed"], bits, torch.Size([n, k])).to(torch.int64)
        else:
            q = tensors[f"{name}.weight"].to(torch.int64)
        s = tensors[f"{name}.weight_scale"].float()
        size = k // s.shape[1]
        z = torch.zeros_like(s, dtype=torch.int64)
        if f"{name}.weight_zero_point" in tensors and not wargs["symmetric"]:
            zp = tensors[f"{name}.weight_zero_point"]
            z = (
                unpack_from_int32(zp, bits, torch.Size([n, s.shape[1]]), packed_dim=0)
                if zp.dtype == torch.int32
                else zp
            ).to(torch.int64)
        mod.weight.data = (q - z.repeat_interleave(size, 1)).float() * s.repeat_interleave(size, 1)
    return model


SOURCES: dict[str, Callable[[Path], Any]] = {
    "gptq-v1-sym-4b-g32": lambda p: write_quantized(p, "gptq", 4, 32, True),
    "gptq-v2-asym-4b-g32": lambda p: write_quantized(p, "gptq_v2", 4, 32, False),
    "gptq-v2-asym-4b-g32-pow2": lambda p: write_quantized(p, "gptq_v2", 4, 32, False, pow2=True),
    "gptq-v1-sym-4b-g128": lambda p: write_quantized(p, "gptq", 4, 128, True),
    "gptq-v1-asym-8b-g64": lambda p: write_quantized(p, "gptq", 8, 64, False),
    "gptq-v2-sym-2b-g32": lambda p: write_quantized(p, "gptq_v2", 2, 32, True),
    "gptq-file-sym-4b-g32": lambda p: write_quantized(p, "gptq", 4, 32, True, config_file=True),
    "awq-gemm-4b-g32": lambda p: write_quantized(p, "awq", 4, 32, False),
    "awq-file-4b-g64": lambda p: write_quantized(p, "awq", 4, 64, False, config_file=True),
    "ct-pack-asym-4b-g32": lambda p: write_compressed_tensors(p, "pack-quantized", 4, 32, False),
    "ct-pack-sym-4b-channel": lambda p: write_compressed_tensors(p, "pack-quantized", 4, None, True),
    "ct-int-sym-8b-channel": lambda p: write_compressed_tensors(p, "int-quantized", 8, None, True),
    "ct-naive-sym-8b-channel": lambda p: write_compressed_tensors(p, "naive-quantized", 8, None, True),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    return made_once(tmp_path_factory, SOURCES)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_compressed_tensors_target_holds_the_sources_codes(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, name: str
) -> None:
    """Every source -> compressed-tensors: no conversion, every weight decodes to the source's own
    decode bit for bit, and transformers (compressed-tensors' decompressor) gives the reference's
    logits with no missing or unexpected keys."""
    src, reference = source(name)
    out = tmp_path / "ct"
    r = compile_to(src, "safetensors", out)
    assert r.code == 0, r.err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["conversions"] == []
    assert (
        manifest["parity"]["rung2_reconstruction"]["bit_exact"] == manifest["parity"]["rung2_reconstruction"]["weights"]
    )
    assert_decodes_equal_reference(out, reference)
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
        out,
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
        dtype=torch.float32,
        output_loading_info=True,
    )
    model, info = loaded
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    # compressed-tensors decodes in the scales' dtype (one rounding), the reference in float32
    assert rel_l2(logits(model.eval()), logits(reference)) < 5e-3


@pytest.mark.parametrize(
    "name", ["ct-pack-asym-4b-g32", "ct-pack-sym-4b-channel", "ct-int-sym-8b-channel", "ct-naive-sym-8b-channel"]
)
def test_a_compressed_tensors_checkpoint_reemits_byte_identical(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, name: str
) -> None:
    """compressed-tensors -> compressed-tensors keeps every stored tensor's bytes (pack-quantized
    re-emits its ``weight_packed`` as it was; int-quantized codes come out in pack-quantized form
    with the same codes)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    src, _ = source(name)
    out = tmp_path / "ct"
    assert compile_to(src, "safetensors", out).code == 0
    before, after = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for key, t in before.items():
        packed = key.removesuffix(".weight") + ".weight_packed"
        if key not in after and packed in after:  # int8 codes stored unpacked: the same codes, packed
            codes = unpack_from_int32(after[packed], 8, t.shape)
            assert torch.equal(codes, t), key
            continue
        assert t.dtype == after[key].dtype, key
        assert torch.equal(t.view(-1).view(torch.uint8), after[key].view(-1).view(torch.uint8)), key
    if "pack" in name:
        assert set(before) == set(after)


def llama_cpp_rel_l2(out: Path, reference: Any) -> float:
    from llama_cpp import Llama

    llm = Llama(model_path=str(out / "model.gguf"), logits_all=True, n_ctx=64, verbose=False)
    llm.eval(IDS)
    return rel_l2(np.array(llm.scores[: len(IDS)], dtype=np.float64), logits(reference))


def ggml_types(out: Path) -> set[str]:
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out / "model.gguf")).tensors}
    return {ty for n, ty in types.items() if n.startswith("blk.") and "norm" not in n}


@pytest.mark.parametrize(
    ("name", "ggml", "kinds"),
    [
        ("gptq-v1-sym-4b-g32", "Q4_0", set[str]()),
        ("gptq-file-sym-4b-g32", "Q4_0", set[str]()),
        ("gptq-v1-sym-4b-g128", "Q4_0", {"regroup"}),
        ("gptq-v2-asym-4b-g32-pow2", "Q4_1", {"affine-min"}),
    ],
)
def test_gguf_holds_the_codes_exactly_and_llama_cpp_runs_them(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, name: str, ggml: str, kinds: set[str]
) -> None:
    """Symmetric 4-bit f16 groups of 32 are Q4_0 blocks as they are; groups of 128 repeat their
    scale per block (``regroup``); asymmetric ones whose ``m = -d*z`` are f16s are Q4_1 blocks
    (``affine-min``). No flag is needed: the rewrites are recorded, lossless, every weight decodes
    to the source's own decode bit for bit, and llama.cpp's logits agree with the reference (its
    int8 activations are the kernel error)."""
    src, reference = source(name)
    out = tmp_path / "gguf"
    r = compile_to(src, "gguf", out)
    assert r.code == 0, r.err
    records = json.loads((out / "manifest.json").read_text())["conversions"]
    assert {c["kind"] for c in records} == kinds
    assert all(c["lossless"] and c["max_abs_err"] == 0.0 for c in records)
    assert ggml_types(out) == {ggml}
    assert_decodes_equal_reference(out, reference)
    assert llama_cpp_rel_l2(out, reference) < 3e-2
    shown = {d["codes_origin"] for d in json.loads(run_cli("inspect", str(out), "--json").out)["descriptors"]}
    assert shown == ({f"preserved ({k}, lossless)" for k in kinds} if kinds else {"preserved"})


@pytest.mark.parametrize(
    ("name", "words", "kinds"),
    [
        ("gptq-v2-asym-4b-g32", ["Q4_1", "move the decode"], {"affine-min"}),
        ("awq-gemm-4b-g32", ["Q4_1", "move the decode"], {"affine-min"}),
        ("ct-pack-asym-4b-g32", ["f16 scales"], {"scale-dtype", "affine-min"}),
    ],
)
def test_asymmetric_weights_that_q4_1_cannot_hold_are_refused_then_measured(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, name: str, words: list[str], kinds: set[str]
) -> None:
    """Where some ``m = -d*z`` is not an f16 (or the scales are bf16), Q4_1 rounds: refused unless
    allowed, then measured and recorded, and llama.cpp runs the result."""
    src, reference = source(name)
    r = compile_to(src, "gguf", tmp_path / "no")
    assert r.code == 1, r.err
    for w in [*words, "--allow-conversion"]:
        assert w in r.err, r.err
    assert not (tmp_path / "no").exists()
    out = tmp_path / "yes"
    r = compile_to(src, "gguf", out, "--allow-conversion")
    assert r.code == 0, r.err
    records = json.loads((out / "manifest.json").read_text())["conversions"]
    assert {c["kind"] for c in records} == kinds
    assert max(float(c["rel_l2"]) for c in records) < 5e-3
    assert ggml_types(out) == {"Q4_1"}
    assert llama_cpp_rel_l2(out, reference) < 3e-2
    shown = [d["codes_origin"] for d in json.loads(run_cli("inspect", str(out), "--json").out)["descriptors"]]
    assert all(o.startswith(f"converted ({', '.join(sorted(kinds, reverse=True))}, rel L2 ") for o in shown), shown


@pytest.mark.parametrize(
    "name", ["gptq-v2-asym-4b-g32", "awq-gemm-4b-g32", "gptq-v1-asym-8b-g64", "ct-pack-asym-4b-g32"]
)
def test_onnx_holds_the_codes_and_zero_points_with_f32_scales(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, name: str
) -> None:
    """MatMulNBits keeps the codes and zero points; its scales are float32, so the f16 scales are
    widened (a conversion, refused unless asked, measured exact), and onnxruntime's logits agree."""
    import onnxruntime as ort

    src, reference = source(name)
    r = compile_to(src, "onnx", tmp_path / "no")
    assert r.code == 1, r.err
    assert "f32 scales" in r.err, r.err
    out = tmp_path / "onnx"
    r = compile_to(src, "onnx", out, "--allow-conversion")
    assert r.code == 0, r.err
    records = json.loads((out / "manifest.json").read_text())["conversions"]
    assert records
    assert {c["kind"] for c in records} == {"scale-dtype"}
    assert all(c["max_abs_err"] == 0.0 for c in records)
    assert_decodes_equal_reference(out, reference)
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = prefill_feed(sess, np.array([IDS], dtype=np.int64))
    got = np.asarray(sess.run(None, feeds)[0])[0].astype(np.float64)
    assert rel_l2(got, logits(reference)) < 1e-4


@pytest.mark.parametrize(
    "name", ["gptq-v2-asym-4b-g32", "awq-gemm-4b-g32", "gptq-v1-asym-8b-g64", "ct-pack-asym-4b-g32"]
)
def test_triton_holds_every_sources_codes(source: Callable[[str], tuple[Path, Any]], tmp_path: Path, name: str) -> None:
    """The Triton target keeps codes, scales and zero points in the kernels' own layout: no conversion,
    the decode is the source's, its kernels pass operator parity on Triton's interpreter (``verify``),
    and the graph gives the reference's logits."""
    from qcompiler.ir.interpret import run_graph

    src, reference = source(name)
    out = tmp_path / "triton"
    r = compile_to(src, "triton", out)
    assert r.code == 0, r.err
    assert json.loads((out / "manifest.json").read_text())["conversions"] == []
    assert_decodes_equal_reference(out, reference)
    assert run_cli("verify", str(out)).code == 0
    got = run_graph(open_artifact(out).module, [torch.tensor([IDS])])[0][0].double().numpy()
    assert rel_l2(got, logits(reference)) < 1e-4


def test_a_scheme_on_a_prequantized_source_is_refused(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path
) -> None:
    src, _ = source("gptq-v1-sym-4b-g32")
    r = run_cli("compile", str(src), "--scheme", "w4-g32", "--target", "safetensors", "-o", str(tmp_path / "o"))
    assert r.code == 1, r.err
    assert "already quantized" in r.err, r.err
    assert "requantize" in r.err, r.err


def broken_copy(src: Path, tmp_path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


Q = "model.layers.0.self_attn.q_proj"


Tensors = dict[str, torch.Tensor]


def drop_zeros(t: Tensors) -> None:
    t.pop(f"{Q}.qzeros")


def add_unknown(t: Tensors) -> None:
    t[f"{Q}.extra"] = torch.zeros(2)


def cut_zeros(t: Tensors) -> None:
    t[f"{Q}.qzeros"] = t[f"{Q}.qzeros"][:1].clone()


def act_order(t: Tensors) -> None:
    t[f"{Q}.g_idx"] = t[f"{Q}.g_idx"].flip(0).contiguous()


def dense_too(t: Tensors) -> None:
    t[f"{Q}.weight"] = torch.zeros(128, 128, dtype=torch.float16)


BROKEN: dict[str, tuple[Callable[[Tensors], None], list[str]]] = {
    "missing-part": (drop_zeros, [f"{Q}.qzeros", "missing"]),
    "unknown-tensor": (add_unknown, [f"{Q}.extra", "no parameter"]),
    "bad-shape": (cut_zeros, [f"{Q}.qzeros", "shape"]),
    "act-order": (act_order, [Q, "act-order"]),
    "dense-and-quantized": (dense_too, [f"{Q}.weight", "no parameter"]),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_gptq_checkpoints_are_refused_by_name(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, case: str
) -> None:
    """Never a random weight: a missing or extra tensor, a misshapen part, an act-order index, a
    layer stored both dense and quantized are typed errors naming the tensor; nothing is written."""
    src, _ = source("gptq-v1-sym-4b-g32")
    edit, words = BROKEN[case]
    r = compile_to(broken_copy(src, tmp_path, edit), "safetensors", tmp_path / "o")
    assert r.code == 1, r.err
    assert "Traceback" not in r.err
    for w in words:
        assert w in r.err, r.err
    assert not (tmp_path / "o").exists()


UNREAD: list[tuple[str, dict[str, object], list[str]]] = [
    ("ct-pack-sym-4b-channel", {"quant_method": "bitsandbytes"}, ["bitsandbytes", "quant_method"]),
    ("awq-gemm-4b-g32", {"version": "gemv"}, ["AWQ layout", "version", "gemv"]),
    ("gptq-v1-sym-4b-g32", {"checkpoint_format": "marlin"}, ["GPTQ layout", "checkpoint_format", "marlin"]),
]


@pytest.mark.parametrize(("name", "change", "words"), UNREAD, ids=["unknown-method", "awq-gemv", "marlin"])
def test_formats_not_read_are_refused_naming_the_field(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, name: str, change: dict[str, object], words: list[str]
) -> None:
    """AWQ gemv, GPTQ marlin and unknown methods: a typed refusal naming the config field
    and what was found, nothing written."""
    src, _ = source(name)
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (dst / "config.json").write_text(json.dumps(cfg))
    r = compile_to(dst, "safetensors", tmp_path / "o")
    assert r.code == 1, r.err
    assert "Traceback" not in r.err
    for w in words:
        assert w in r.err, r.err
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """GGUF artifacts (Q4_0 blocks; q4_k_m K-quants) whose ``model.gguf`` is then a SOURCE."""
    root = tmp_path_factory.mktemp("gguf-src")
    out: dict[str, Path] = {}
    for scheme, src in (("w4-g32", "tiny_llama_hf"), ("q4_k_m", "tiny_llama_wide_untied_hf")):
        r = run_cli(
            "compile", f"qcompiler.examples:{src}", "--scheme", scheme, "--target", "gguf", "-o", str(root / scheme)
        )
        assert r.code == 0, r.err
        out[scheme] = root / scheme
    return out


@pytest.mark.parametrize(
    ("scheme", "target", "kinds"),
    [
        ("w4-g32", "triton", set[str]()),
        ("w4-g32", "onnx", {"scale-dtype"}),
        ("q4_k_m", "triton", {"dense"}),
        ("q4_k_m", "onnx", {"dense"}),
    ],
)
def test_a_gguf_source_into_triton_and_onnx(
    gguf_files: dict[str, Path], tmp_path: Path, scheme: str, target: str, kinds: set[str]
) -> None:
    """Q4_0 blocks are Triton's codes as they are; onnxruntime reads f32 scales (widened, error 0);
    K-quants have no form in either (dense, error 0 in f32). The graph gives the source's logits."""
    from qcompiler.ir.interpret import run_graph

    src = gguf_files[scheme]
    out = tmp_path / target
    args = ("--allow-conversion",) if kinds else ()
    r = compile_to(src / "model.gguf", target, out, *args)
    assert r.code == 0, r.err
    records = json.loads((out / "manifest.json").read_text())["conversions"]
    assert {c["kind"] for c in records} == kinds
    assert all(c["max_abs_err"] == 0.0 for c in records)
    if kinds:
        assert compile_to(src / "model.gguf", target, tmp_path / "no").code == 1
    ids = [torch.tensor([IDS[:16]]).remainder(128)]
    want = run_graph(open_artifact(src).module, ids)[0].double().numpy()
    got = run_graph(open_artifact(out).module, ids)[0].double().numpy()
    assert rel_l2(got, want) < 1e-5

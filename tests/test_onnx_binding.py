"""The ONNX binding gate: every byte onnxruntime reads is what the artifact's ``graph.qir`` lowers to.

Each corruption below is applied with the manifest re-hashed (sha256s are not signatures: anyone can
recompute them), so only the reader's own gates can notice. Each is refused by ``open_artifact`` and by
``qcompiler verify`` (exit 1), naming the file and the initializer, node or field. For the swap of
``lm_head``/``embed_tokens``, an offset shift and a flipped constant in either graph, onnxruntime shows that
the corruption really changes the logits (without the gate, the artifact would say something else than
its graph). The artifacts hold both graphs (``--onnx-no-cache-graph``). Then one test per malformed
input that used to escape as an untyped exception.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from qcompiler.artifact.reader import ArtifactError, open_artifact
from qcompiler.artifact.writer import MANIFEST
from qcompiler.backends.onnx.dispatch import optimized_report, session_options
from qcompiler.backends.onnx.feeds import prefill_feed
from qcompiler.testing import rehash, run_cli

LLAMA = "qcompiler.examples:tiny_llama_hf"
MODEL, NO_CACHE, DATA = "model.onnx", "model_no_cache.onnx", "model.onnx.data"
Edit = Callable[[onnx.ModelProto], None]


def compile_to(out: Path, target: str) -> Path:
    r = run_cli("compile", LLAMA, "--scheme", "w4-g32", "--target", target, "--onnx-no-cache-graph", "-o", str(out))
    assert r.code == 0, r.err
    return out


@pytest.fixture(scope="module")
def nbits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_to(tmp_path_factory.mktemp("nbits") / "art", "onnx-nbits")


@pytest.fixture(scope="module")
def qdq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_to(tmp_path_factory.mktemp("qdq") / "art", "onnx-qdq")


def copy(src: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "copy"
    shutil.copytree(src, dest)
    return dest


def edit_model(path: Path, name: str, edit: Edit) -> None:
    model = onnx.load(str(path / name), load_external_data=False)
    edit(model)
    (path / name).write_bytes(model.SerializeToString())
    rehash(path)


def refused(path: Path) -> ArtifactError:
    """The error ``open_artifact`` raises; ``qcompiler verify --json`` exits 1 with the same message."""
    with pytest.raises(ArtifactError) as e:
        open_artifact(path)
    r = run_cli("verify", str(path), "--json")
    assert r.code == 1
    assert json.loads(r.out)["error"] == str(e.value)
    return e.value


def init(model: onnx.ModelProto, name: str) -> onnx.TensorProto:
    return next(t for t in model.graph.initializer if t.name == name)


def entries(t: onnx.TensorProto) -> dict[str, onnx.StringStringEntryProto]:
    return {e.key: e for e in t.external_data}


# ------------------------------------------------------------------------------------------- the corruptions


def swap_tables(model: onnx.ModelProto) -> None:
    """``lm_head`` and ``embed_tokens`` trade their external ranges (same shape, both valid bytes)."""
    a, b = init(model, "lm_head.weight"), init(model, "model.embed_tokens.weight")
    assert list(a.dims) == list(b.dims)
    ea, eb = entries(a)["offset"], entries(b)["offset"]
    ea.value, eb.value = eb.value, ea.value


def shift_lm_head(model: onnx.ModelProto) -> None:
    """``lm_head``'s offset one page earlier: still inside the file, the right length, other bytes."""
    offset = entries(init(model, "lm_head.weight"))["offset"]
    offset.value = str(int(offset.value) - 4096)


def flip_inline(model: onnx.ModelProto) -> None:
    """One bit of an inline constant (the attention scale, 4 bytes in ``raw_data``)."""
    t = init(model, "scaled_dot_product_attention_scale")
    raw = bytearray(t.raw_data)
    raw[3] ^= 0x01
    t.raw_data = bytes(raw)


def rename_swap(model: onnx.ModelProto) -> None:
    """Two initializers of the same shape trade names (and so the nodes that read them)."""
    a, b = init(model, "lm_head.weight"), init(model, "model.embed_tokens.weight")
    a.name, b.name = b.name, a.name


def retype_header(model: onnx.ModelProto) -> None:
    """The graph output's declared dtype (a header of the model) changes."""
    model.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT16


def retype_initializer(model: onnx.ModelProto) -> None:
    """``lm_head``'s header says int32 instead of float: the same byte size, other values."""
    init(model, "lm_head.weight").data_type = onnx.TensorProto.INT32


def reshape_initializer(model: onnx.ModelProto) -> None:
    """``lm_head``'s header says ``[64, 128]`` instead of ``[128, 64]``: the same bytes, read transposed."""
    t = init(model, "lm_head.weight")
    t.dims[:] = list(reversed(t.dims))


def reshape_input(model: onnx.ModelProto) -> None:
    """The graph input's dynamic dim ``seq`` becomes a fixed 9."""
    dim = model.graph.input[0].type.tensor_type.shape.dim[1]
    dim.dim_value = 9


def softmax_axis(model: onnx.ModelProto) -> None:
    node = next(n for n in model.graph.node if n.op_type == "Softmax")
    next(a for a in node.attribute if a.name == "axis").i = -2


def extra_node(model: onnx.ModelProto) -> None:
    model.graph.node.append(helper.make_node("Identity", ["input_ids"], ["spare"], name="spare"))


def extra_initializer(model: onnx.ModelProto) -> None:
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(3, np.float32), "spare"))


def drop_unused_initializer(model: onnx.ModelProto) -> None:
    """An initializer that only one node reads is replaced by a node computing the same constant."""
    t = init(model, "scaled_dot_product_attention_scale")
    model.graph.initializer.remove(t)
    model.graph.node.insert(0, helper.make_node("Constant", [], [t.name], name="moved", value=t))


def missing_node(model: onnx.ModelProto) -> None:
    """The output's ``Identity`` goes: the node before it writes ``logits`` itself."""
    last = model.graph.node[-1] if model.graph.node[-1].output[0] == "logits" else None
    last = last or next(n for n in model.graph.node if n.output[0] == "logits")
    before = next(n for n in model.graph.node if last.input[0] in n.output)
    before.output[0] = "logits"
    model.graph.node.remove(last)


def older_ir(model: onnx.ModelProto) -> None:
    model.ir_version = 11


def newer_opset(model: onnx.ModelProto) -> None:
    next(o for o in model.opset_import if o.domain == "").version = 22


CORRUPTIONS: dict[str, tuple[Edit, str, str]] = {
    # name: (edit, the initializer or node the message names, the field it names)
    "swap_tables": (swap_tables, "model.embed_tokens.weight", "external_data.offset"),
    "shift_offset": (shift_lm_head, "lm_head.weight", "external_data.offset"),
    "flip_inline": (flip_inline, "scaled_dot_product_attention_scale", "raw_data"),
    "rename_swap": (rename_swap, "model.embed_tokens.weight", "graph.initializer[0]"),
    "retype_header": (retype_header, "", "graph.output[0] 'logits'.type.tensor_type.elem_type"),
    "retype_initializer": (retype_initializer, "lm_head.weight", "data_type"),
    "reshape_initializer": (reshape_initializer, "lm_head.weight", "dims"),
    "reshape_input": (reshape_input, "", "graph.input[0] 'input_ids'.type.tensor_type.shape.dim[1]"),
    "softmax_axis": (softmax_axis, "", "attribute['axis'].i"),
    "extra_node": (extra_node, "", "extra 'spare'"),
    "extra_initializer": (extra_initializer, "spare", "graph.initializer"),
    "missing_initializer": (drop_unused_initializer, "", "extra 'moved'"),
    "missing_node": (missing_node, "", "graph.node"),
    "ir_version": (older_ir, "", "ir_version"),
    "opset": (newer_opset, "", "opset_import[0].version"),
}


def test_the_untouched_artifacts_verify_with_the_binding_gate(nbits: Path, qdq: Path) -> None:
    for art in (nbits, qdq):
        assert "binding" in open_artifact(art).gates
        r = run_cli("verify", str(art), "--json")
        assert r.code == 0, r.out
        assert "binding" in json.loads(r.out)["gates"]


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
@pytest.mark.parametrize("file", [MODEL, NO_CACHE])
def test_a_corrupted_nbits_model_is_refused(nbits: Path, tmp_path: Path, file: str, name: str) -> None:
    edit, tensor, field = CORRUPTIONS[name]
    art = copy(nbits, tmp_path)
    edit_model(art, file, edit)
    e = refused(art)
    if e.file.split(":")[0] == "graph.qir":  # graph.qir reads its tensors from model.onnx: the graph gate saw it first
        assert file == MODEL, str(e)
        assert f"tensor @{tensor}" in e.message, str(e)
        return
    assert e.file == file, str(e)
    if e.message.startswith("differs from what graph.qir lowers to"):
        assert e.tensor == tensor, str(e)
        assert field in f"{e.field} {e.found}", str(e)
    else:  # onnx.checker saw it first: MatMul's inputs disagree in type
        assert name == "retype_initializer", str(e)
        assert e.message.startswith("onnx.checker:"), str(e)


@pytest.mark.parametrize("name", ["swap_tables", "shift_offset", "softmax_axis", "extra_initializer"])
def test_a_corrupted_qdq_model_is_refused(qdq: Path, tmp_path: Path, name: str) -> None:
    edit, tensor, field = CORRUPTIONS[name]
    art = copy(qdq, tmp_path)
    edit_model(art, NO_CACHE, edit)
    e = refused(art)
    assert (e.file, e.tensor) == (NO_CACHE, tensor), str(e)
    assert field in f"{e.field} {e.found}", str(e)


@pytest.mark.parametrize("name", ["swap_tables", "shift_offset", "flip_inline"])
@pytest.mark.parametrize("file", [MODEL, NO_CACHE])
def test_the_refused_corruptions_change_what_onnxruntime_computes(
    nbits: Path, tmp_path: Path, file: str, name: str
) -> None:
    """Without the gate these would pass: onnxruntime's logits move, while the graph says otherwise."""
    art = copy(nbits, tmp_path)
    edit_model(art, file, CORRUPTIONS[name][0])
    before, after = ort_logits(nbits / file), ort_logits(art / file)
    print(f"{file} {name}: onnxruntime logits move by up to {np.abs(after - before).max():.3g}")
    assert np.abs(after - before).max() > 1e-3


def ort_logits(path: Path) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), sess_options=session_options(1), providers=["CPUExecutionProvider"])
    ids = np.array([[5, 17, 99, 3, 42, 7]], np.int64)
    return np.asarray(sess.run(["logits"], prefill_feed(sess, ids))[0], np.float64)


# ---------------------------------------------------------------------------- the data file and the manifest


def test_a_flipped_padding_byte_in_the_data_file_is_refused(nbits: Path, tmp_path: Path) -> None:
    """Between two initializers: no gate before this one reads it."""
    art = copy(nbits, tmp_path)
    data = bytearray((art / DATA).read_bytes())
    model = onnx.load(str(art / MODEL), load_external_data=False)
    ends = [
        int(entries(t)["offset"].value) + int(entries(t)["length"].value)
        for t in model.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
    ]
    end = next(e for e in ends if e % 4096)
    data[end] ^= 0xFF
    (art / DATA).write_bytes(bytes(data))
    rehash(art)
    e = refused(art)
    assert (e.file, e.field) == (DATA, f"bytes {end}..{-(-end // 4096) * 4096}"), str(e)
    assert "padding" in e.message


def test_bytes_appended_to_the_data_file_are_refused(nbits: Path, tmp_path: Path) -> None:
    art = copy(nbits, tmp_path)
    with (art / DATA).open("ab") as f:
        f.write(b"\0" * 4096)
    rehash(art)
    e = refused(art)
    assert (e.file, e.field) == (DATA, "size"), str(e)


def test_a_missing_no_cache_graph_is_refused(nbits: Path, tmp_path: Path) -> None:
    """The manifest records that it was written (``provenance.no_cache_graph``)."""
    art = copy(nbits, tmp_path)
    (art / NO_CACHE).unlink()
    rehash(art)
    e = refused(art)
    assert (e.file, e.expected, e.found) == (NO_CACHE, "present", "missing"), str(e)


def test_a_no_cache_graph_the_manifest_does_not_record_is_refused(nbits: Path, tmp_path: Path) -> None:
    art = copy(nbits, tmp_path)
    manifest = json.loads((art / MANIFEST).read_text())
    manifest["provenance"]["no_cache_graph"] = False
    (art / MANIFEST).write_text(json.dumps(manifest))
    rehash(art)
    e = refused(art)
    assert (e.file, e.expected, e.found) == (NO_CACHE, "absent", "present"), str(e)


@pytest.mark.parametrize(
    ("where", "value", "field"),
    [
        (("provenance", "accuracy_level"), 4, "attribute['accuracy_level'].i"),
        (("provenance", "accuracy_level"), "1", "provenance.accuracy_level"),
        (("versions", "onnx_form"), "qdq", "versions.onnx_form"),
        (("versions", "onnx_form"), ["nbits"], "versions.onnx_form"),  # once a TypeError (unhashable)
        (("provenance", "no_cache_graph"), "true", "provenance.no_cache_graph"),
        (("provenance", "onnx_attention"), "gqa", "graph.node"),  # lowered with GroupQueryAttention: differs
        (("provenance", "onnx_attention"), "fused", "provenance.onnx_attention"),
        (("provenance", "onnx_attention"), ["gqa"], "provenance.onnx_attention"),
    ],
)
def test_the_recorded_emit_options_are_bound_to_the_files(
    nbits: Path, tmp_path: Path, where: tuple[str, str], value: object, field: str
) -> None:
    art = copy(nbits, tmp_path)
    manifest = json.loads((art / MANIFEST).read_text())
    manifest[where[0]][where[1]] = value
    (art / MANIFEST).write_text(json.dumps(manifest))
    rehash(art)
    e = refused(art)
    assert field in e.field, str(e)


# ----------------------------------------------------------------- malformed inputs that used to escape untyped


def test_a_missing_model_file_is_a_typed_error(nbits: Path, tmp_path: Path) -> None:
    from qcompiler.backends.onnx.blobs import load_model
    from qcompiler.errors import BlobError

    art = copy(nbits, tmp_path)
    (art / MODEL).unlink()
    with pytest.raises(BlobError, match="is missing"):
        load_model(art / MODEL)
    rehash(art)
    assert refused(art).file == MODEL


def test_an_inline_initializer_of_the_wrong_size_is_a_typed_error(nbits: Path, tmp_path: Path) -> None:
    """``as_array`` once reshaped whatever bytes it found; now the length is checked against dims first."""
    from qcompiler.backends.onnx.blobs import as_array, open_onnx
    from qcompiler.errors import BlobError

    art = copy(nbits, tmp_path)
    name = "model.layers.0.input_layernorm.weight"
    edit_model(art, MODEL, lambda m: setattr(init(m, name), "raw_data", init(m, name).raw_data[:-4]))
    f = open_onnx(art / MODEL)
    with pytest.raises(BlobError, match="is 256 bytes, found 252"):
        as_array(f, name, bytes(f.initializers[name].raw_data))
    e = refused(art)
    assert e.file in (MODEL, "graph.qir"), str(e)


def test_text_that_is_not_utf8_in_external_data_is_a_typed_error(nbits: Path, tmp_path: Path) -> None:
    """protobuf hands back such a field as bytes; the checks once used it as a str."""
    art = copy(nbits, tmp_path)
    data = (art / MODEL).read_bytes()
    key = b"\x0a\x06offset"  # StringStringEntryProto.key = "offset" ...
    at = data.index(key)
    value_at = at + len(key) + 2  # ... then field 2 (tag, length) and the value's first byte
    broken = data[:value_at] + b"\xff" + data[value_at + 1 :]
    (art / MODEL).write_bytes(broken)
    rehash(art)
    e = refused(art)
    assert (e.file, e.field) == (MODEL, "external_data"), str(e)
    assert "UTF-8" in e.message


def test_a_checker_failure_of_another_type_is_a_typed_error(nbits: Path, tmp_path: Path) -> None:
    """onnx.checker raised a UnicodeDecodeError on a node name that is not UTF-8."""
    art = copy(nbits, tmp_path)
    model = onnx.load(str(art / MODEL), load_external_data=False)
    name = model.graph.node[0].name.encode()
    data = (art / MODEL).read_bytes()
    at = data.index(b"\x1a" + bytes([len(name)]) + name)  # NodeProto.name: field 3, length-delimited
    (art / MODEL).write_bytes(data[: at + 2] + b"\xc7" + data[at + 3 :])
    rehash(art)
    e = refused(art)
    assert e.file == MODEL, str(e)


def test_onnxruntime_refusing_a_model_is_a_failed_dispatch_proof(nbits: Path, tmp_path: Path) -> None:
    """The dispatch proof once let onnxruntime's ``Fail``/``InvalidGraph`` escape; now it reports them."""
    art = copy(nbits, tmp_path)
    edit_model(art, MODEL, lambda m: setattr(init(m, "c_0"), "raw_data", b"\0" * 7))
    report = optimized_report(art / MODEL, 1, 14)
    assert report["ok"] is False
    assert report["error"].startswith("model.onnx: onnxruntime cannot load it ("), report


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("end = 9223372036854775807,", "end = 9223372036864775807,", "integer outside the int64 range"),
        (
            "group=(axis=1, size=32,",
            "group=(axis=1, size=52,",
            "does not lower to ONNX as it was emitted: model.layers.0.self_attn.q_proj.weight: group size 52 has no",
        ),
    ],
)
def test_a_graph_that_verifies_but_does_not_lower_is_a_typed_error(
    nbits: Path, tmp_path: Path, old: str, new: str, message: str
) -> None:
    """A crafted ``graph.qir`` the verifier accepts once crashed the lowering (int64 overflow, a division
    by a zero block). The int64 overflow is now refused by the IR parser (at its line and column), the
    block by the binding gate, both as the graph's."""
    art = copy(nbits, tmp_path)
    text = (art / "graph.qir").read_text()
    assert old in text
    (art / "graph.qir").write_text(text.replace(old, new, 1))
    rehash(art)
    e = refused(art)
    assert e.file.split(":")[0] == "graph.qir", str(e)
    assert message in e.message, str(e)

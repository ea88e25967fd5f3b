"""ONNX external data: ``externalize`` writes what onnx and onnxruntime load, ``check_external_data`` refuses the rest.

A real model (MatMul on a float32 initializer, plus INT4 block-quantized weights through DequantizeLinear, plus an
odd-count INT4 tensor) is externalized, saved, checked by ``onnx.checker`` and run by onnxruntime; then each
refusal is produced by editing the ``external_data`` entries or the files on disk.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from qcompiler.artifact.reader import ArtifactError
from qcompiler.backends.onnx import external as ext
from qcompiler.backends.onnx import external_check as chk

MODEL, DATA = "model.onnx", "weights.bin"
TP = onnx.TensorProto


def build_model() -> onnx.ModelProto:
    """Y = X @ W + X @ dequant(Q, S) with Q INT4 [64, 32] in blocks of 32 along axis 0; Z = dequant(Q_odd, s)."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    q = rng.integers(-8, 8, size=(64, 32)).tolist()
    q_odd = rng.integers(-8, 8, size=(5, 7)).tolist()
    scale = (rng.random((2, 32)) * 0.1 + 0.01).astype(np.float32)
    inits = [
        onnx.numpy_helper.from_array(w, "W"),
        helper.make_tensor("Q", TP.INT4, [64, 32], q, raw=False),
        onnx.numpy_helper.from_array(scale, "S"),
        helper.make_tensor("Q_odd", TP.INT4, [5, 7], q_odd, raw=False),
        helper.make_tensor("s_odd", TP.FLOAT, [], [0.25]),
    ]
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["H1"]),
        helper.make_node("DequantizeLinear", ["Q", "S"], ["Wq"], axis=0, block_size=32),
        helper.make_node("MatMul", ["X", "Wq"], ["H2"]),
        helper.make_node("Add", ["H1", "H2"], ["Y"]),
        helper.make_node("DequantizeLinear", ["Q_odd", "s_odd"], ["Z"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qc_external",
        [helper.make_tensor_value_info("X", TP.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("Y", TP.FLOAT, [1, 32]), helper.make_tensor_value_info("Z", TP.FLOAT, [5, 7])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def run(model: onnx.ModelProto | str) -> list[np.ndarray]:
    source = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    return [np.asarray(out) for out in session.run(None, {"X": x})]


def save(model: onnx.ModelProto, root: Path) -> list[ext.ExternalRef]:
    """Externalize every initializer of ``model`` into ``root``; return the refs ``check_external_data`` found."""
    root.mkdir(parents=True, exist_ok=True)
    (root / DATA).write_bytes(ext.externalize(model, DATA, threshold=1))
    onnx.save(model, str(root / MODEL))
    return chk.check_external_data(model, root, MODEL)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[onnx.ModelProto, Path]:
    model = build_model()
    root = tmp_path / "artifact"
    save(model, root)
    return model, root


def entries(model: onnx.ModelProto, tensor: str = "W") -> onnx.TensorProto:
    return next(t for t in model.graph.initializer if t.name == tensor)


def set_key(t: onnx.TensorProto, key: str, value: str) -> None:
    for e in t.external_data:
        if e.key == key:
            e.value = value
            return
    e = t.external_data.add()
    e.key, e.value = key, value


def refused(model: onnx.ModelProto, root: Path, match: str, tensor: str = "W") -> ArtifactError:
    with pytest.raises(ArtifactError, match=match) as info:
        chk.check_external_data(model, root, MODEL)
    assert f"tensor '{tensor}'" in str(info.value)
    return info.value


# ---------------------------------------------------------------------------------------------------------- writing


def test_externalize_roundtrip_runs_in_onnxruntime(tmp_path: Path) -> None:
    inline = build_model()
    expected = run(inline)
    model = build_model()
    refs = save(model, tmp_path)
    assert [r.tensor for r in refs] == ["W", "Q", "S", "Q_odd", "s_odd"]
    for t, r in zip(model.graph.initializer, refs, strict=True):
        assert t.data_location == TP.EXTERNAL
        assert [e.key for e in t.external_data] == list(ext.ALLOWED_KEYS)
        assert not t.HasField("raw_data")
        assert len(t.int32_data) == len(t.float_data) == 0
        assert r.offset % ext.PAGE == 0
        assert r.length == ext.tensor_nbytes(t)
    assert refs[1].length == 64 * 32 // 2  # INT4, two codes a byte
    assert refs[3].length == 18  # 35 codes -> 18 bytes
    blob = (tmp_path / DATA).read_bytes()
    assert len(blob) == refs[-1].offset + refs[-1].length
    assert blob[refs[0].length : refs[1].offset] == bytes(refs[1].offset - refs[0].length)  # zero padding

    onnx.checker.check_model(str(tmp_path / MODEL), full_check=True)
    reloaded = onnx.load(str(tmp_path / MODEL), load_external_data=False)
    assert chk.check_external_data(reloaded, tmp_path, MODEL) == refs
    got = run(str(tmp_path / MODEL))
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


def test_threshold_keeps_small_initializers_inline(tmp_path: Path) -> None:
    model = build_model()
    blob = ext.externalize(model, DATA, threshold=1024)
    external = [t.name for t in model.graph.initializer if t.data_location == TP.EXTERNAL]
    assert external == ["W", "Q"]  # 8192 and 1024 bytes; S is 256, Q_odd 18, s_odd 4
    assert len(blob) == 2 * ext.PAGE + 1024


@pytest.mark.parametrize("location", ["", "sub/w.bin", "../w.bin", "/tmp/w.bin", "..", "C:w.bin", "a\\b.bin"])
def test_externalize_refuses_non_plain_location(location: str) -> None:
    with pytest.raises(ValueError, match="plain relative file name"):
        ext.externalize(build_model(), location)


def test_tensor_nbytes() -> None:
    assert ext.tensor_nbytes(helper.make_tensor("q", TP.INT4, [7], [0] * 7)) == 4
    assert ext.tensor_nbytes(helper.make_tensor("q", TP.UINT4, [3, 3], [0] * 9)) == 5
    assert ext.tensor_nbytes(helper.make_tensor("f", TP.FLOAT, [], [1.0])) == 4
    assert ext.tensor_nbytes(helper.make_tensor("d", TP.DOUBLE, [2, 0], [])) == 0
    huge = TP(name="h", data_type=TP.FLOAT16, dims=[2**40, 2**40])
    assert ext.tensor_nbytes(huge) == 2**81  # python ints: no overflow
    if hasattr(TP, "INT2"):
        assert ext.tensor_nbytes(TP(name="i2", data_type=TP.INT2, dims=[5])) == 2
    with pytest.raises(ValueError, match="negative dim"):
        ext.tensor_nbytes(TP(name="n", data_type=TP.FLOAT, dims=[-1, 4]))
    with pytest.raises(ValueError, match="no fixed byte size"):
        ext.tensor_nbytes(TP(name="s", data_type=TP.STRING, dims=[2]))


# ---------------------------------------------------------------------------------------------------------- refusals


def test_refuses_parent_traversal(saved: tuple[onnx.ModelProto, Path]) -> None:
    model, root = saved
    shutil.copy(root / DATA, root.parent / "outside.bin")  # exists and is well-formed: only containment stops it
    set_key(entries(model), "location", "../outside.bin")
    e = refused(model, root, "location escapes the artifact directory")
    assert e.file == MODEL
    assert e.field == "external_data.location"


def test_refuses_nested_traversal(saved: tuple[onnx.ModelProto, Path]) -> None:
    model, root = saved
    (root / "sub").mkdir()
    shutil.copy(root / DATA, root.parent / "outside.bin")
    set_key(entries(model), "location", "sub/../../outside.bin")
    refused(model, root, "location escapes the artifact directory")


def test_refuses_dotdot_even_when_it_resolves_inside(saved: tuple[onnx.ModelProto, Path]) -> None:
    model, root = saved
    (root / "sub").mkdir()
    set_key(entries(model), "location", f"sub/../{DATA}")
    refused(model, root, "location has a '..' component")


def test_refuses_absolute_path(saved: tuple[onnx.ModelProto, Path]) -> None:
    model, root = saved
    set_key(entries(model), "location", str(root / DATA))
    refused(model, root, "location is an absolute path")


@pytest.mark.parametrize(
    ("location", "match"),
    [
        ("C:weights.bin", "drive letter"),
        ("sub\\weights.bin", "backslash"),
        ("w\0.bin", "NUL"),
        ("", "is empty"),
        (f"./{DATA}", "'.' component"),
        (f"{DATA}/", "empty"),
    ],
)
def test_refuses_malformed_location(saved: tuple[onnx.ModelProto, Path], location: str, match: str) -> None:
    model, root = saved
    set_key(entries(model), "location", location)
    refused(model, root, match)


def test_refuses_symlinked_data_file(saved: tuple[onnx.ModelProto, Path]) -> None:
    model, root = saved
    os.replace(root / DATA, root / "copy.bin")
    os.symlink("copy.bin", root / DATA)
    e = refused(model, root, "is a symbolic link")
    assert e.file == DATA


def test_refuses_symlinked_parent_directory(saved: tuple[onnx.ModelProto, Path]) -> None:
    model, root = saved
    (root / "real").mkdir()
    os.replace(root / DATA, root / "real" / DATA)
    os.symlink("real", root / "link")
    set_key(entries(model), "location", f"link/{DATA}")
    refused(model, root, "passes through a symbolic link directory")


def test_refuses_symlinked_parent_directory_outside(saved: tuple[onnx.ModelProto, Path]) -> None:
    model, root = saved
    outside = root.parent / "elsewhere"
    outside.mkdir()
    shutil.copy(root / DATA, outside / DATA)
    os.symlink(outside, root / "link")
    set_key(entries(model), "location", f"link/{DATA}")
    refused(model, root, "location escapes the artifact directory")


def test_refuses_hardlink(saved: tuple[onnx.ModelProto, Path]) -> None:
    model, root = saved
    os.link(root / DATA, root.parent / "alias.bin")
    refused(model, root, "has 2 hard links")


def test_refuses_missing_and_non_regular_file(saved: tuple[onnx.ModelProto, Path]) -> None:
    model, root = saved
    set_key(entries(model), "location", "nope.bin")
    refused(model, root, "data file is missing")
    (root / "dir.bin").mkdir()
    set_key(entries(model), "location", "dir.bin")
    refused(model, root, "is not a regular file")


def test_refuses_truncated_file(saved: tuple[onnx.ModelProto, Path]) -> None:
    model, root = saved
    last = chk.check_external_data(model, root, MODEL)[-1]
    os.truncate(root / DATA, last.offset + last.length - 1)
    e = refused(model, root, r"offset \+ length past the end of the file", tensor=last.tensor)
    assert e.file == DATA


def test_refuses_wrong_length(saved: tuple[onnx.ModelProto, Path]) -> None:
    model, root = saved
    t = entries(model)
    set_key(t, "length", str(ext.tensor_nbytes(t) - 1))
    e = refused(model, root, "length does not match the tensor's dims and type")
    assert e.field == "external_data.length"
    assert e.expected == 64 * 32 * 4


def test_refuses_dims_that_disagree_with_length(saved: tuple[onnx.ModelProto, Path]) -> None:
    model, root = saved
    entries(model, "Q").dims[0] = 66  # the file holds 64 rows; the model claims 66
    refused(model, root, "length does not match", tensor="Q")


@pytest.mark.parametrize(
    ("key", "match"),
    [("evil", "unknown external_data key"), ("checksum", "checksum key is refused"), ("offset", "duplicate")],
)
def test_refuses_keys(saved: tuple[onnx.ModelProto, Path], key: str, match: str) -> None:
    model, root = saved
    e = entries(model).external_data.add()
    e.key, e.value = key, "0"
    refused(model, root, match)


def test_refuses_missing_location(saved: tuple[onnx.ModelProto, Path]) -> None:
    model, root = saved
    t = entries(model)
    kept = [(e.key, e.value) for e in t.external_data if e.key != "location"]
    del t.external_data[:]
    for key, value in kept:
        set_key(t, key, value)
    refused(model, root, "location is missing")


@pytest.mark.parametrize("value", ["0x10", "-1", "+1", " 1", "1 ", "", "010", "1e3", "٣"])
def test_refuses_non_canonical_offset(saved: tuple[onnx.ModelProto, Path], value: str) -> None:
    model, root = saved
    set_key(entries(model), "offset", value)
    e = refused(model, root, "offset is not a canonical non-negative decimal integer")
    assert repr(value) in str(e)


def test_refuses_out_of_range_length(saved: tuple[onnx.ModelProto, Path]) -> None:
    model, root = saved
    set_key(entries(model), "length", "9" * 30)
    refused(model, root, "length is out of range")


def test_absent_offset_and_length_default(saved: tuple[onnx.ModelProto, Path]) -> None:
    model, root = saved
    t = entries(model)
    del t.external_data[:]
    set_key(t, "location", DATA)
    assert chk.check_external_data(model, root, MODEL)[0] == ext.ExternalRef("W", DATA, 0, 64 * 32 * 4)


def _add_raw_data(t: onnx.TensorProto) -> None:
    t.raw_data = bytes(ext.tensor_nbytes(t))


def _add_float_data(t: onnx.TensorProto) -> None:
    t.float_data.append(1.0)


def _make_default_location(t: onnx.TensorProto) -> None:
    t.data_location = TP.DEFAULT


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_add_raw_data, "carries inline data as well as external data"),
        (_add_float_data, "carries inline data as well as external data"),
        (_make_default_location, "data_location is not EXTERNAL"),
    ],
)
def test_refuses_mixed_inline_and_external(
    saved: tuple[onnx.ModelProto, Path], edit: Callable[[onnx.TensorProto], None], match: str
) -> None:
    model, root = saved
    edit(entries(model))
    refused(model, root, match)


def test_walks_node_attributes_in_subgraphs(saved: tuple[onnx.ModelProto, Path]) -> None:
    model, root = saved
    value = TP(name="c", data_type=TP.FLOAT, dims=[4], data_location=TP.EXTERNAL)
    set_key(value, "location", "../outside.bin")
    branch = helper.make_graph(
        [helper.make_node("Constant", [], ["c_out"], value=value)],
        "then",
        [],
        [helper.make_tensor_value_info("c_out", TP.FLOAT, [4])],
    )
    model.graph.node.append(helper.make_node("If", ["cond"], ["if_out"], then_branch=branch, else_branch=branch))
    refused(model, root, "location escapes the artifact directory", tensor="c")

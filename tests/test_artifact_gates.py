"""The artifact contract: transactional publish of a real safetensors artifact (a failure injected at
every writer step), and the production reader's gates (``qcompiler verify``) catching a flipped byte
in any file, a missing shard, an index pointing at the wrong shard and a scale grouped along the
wrong axis, each with a precise message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qcompiler.api import Captured, capture_source
from qcompiler.artifact.reader import ArtifactError, open_artifact
from qcompiler.artifact.request import ArtifactRequest
from qcompiler.artifact.writer import MANIFEST, STEPS, InjectedFailure
from qcompiler.backends import get_backend
from qcompiler.backends.safetensors.container import open_file
from qcompiler.backends.safetensors.container_write import TensorBytes, serialize
from qcompiler.ir.core import Module
from qcompiler.passes.manager import PassManager
from qcompiler.passes.spec import parse_pipeline
from qcompiler.testing import rehash, run_cli

LLAMA = "qcompiler.examples:tiny_llama_hf"
FRONT = "freeze-semantics,canonicalize-axes,place-shards{target=safetensors,max-shard-size=60KB},pack-layouts,fuse-qdq"


@pytest.fixture(scope="module")
def captured() -> tuple[Captured, Module]:
    c = capture_source(LLAMA, scheme="w4-g32")
    return c, PassManager(parse_pipeline(FRONT)).run(c.module)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("single") / "art"
    r = run_cli("compile", LLAMA, "--scheme", "w4-g32", "--target", "safetensors", "-o", str(out))
    assert r.code == 0, r.err
    return out


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sharded") / "art"
    args = ("--scheme", "w4-g32", "--target", "safetensors", "--max-shard-size", "60KB", "-o", str(out))
    r = run_cli("compile", LLAMA, *args)
    assert r.code == 0, r.err
    return out


def copy(src: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "copy"
    shutil.copytree(src, dest)
    return dest


def verify_error(path: Path) -> str:
    r = run_cli("verify", str(path), "--json")
    result = json.loads(r.out)
    assert r.code == 1
    assert result["ok"] is False
    return str(result["error"])


def snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


# --------------------------------------------------------------------------- transactional publish


@pytest.mark.parametrize("step", STEPS)
def test_failure_at_any_step_never_publishes_a_partial_artifact(
    captured: tuple[Captured, Module], tmp_path: Path, step: str
) -> None:
    c, m = captured
    out = tmp_path / "art"
    backend = get_backend("safetensors")
    backend.emit(m, ArtifactRequest(out, c.source, c.effective, c.float_weights))
    before = snapshot(out)
    with pytest.raises(InjectedFailure, match=f"step '{step}'"):
        backend.emit(m, ArtifactRequest(out, c.source, c.effective, c.float_weights, fail_at=step))
    open_artifact(out)  # whatever is at the destination is whole
    if step != "cleanup":  # before the swap, the previous artifact is untouched
        assert snapshot(out) == before
        assert [p.name for p in tmp_path.iterdir()] == ["art"]


def test_published_artifact_reopens_and_verifies(single: Path) -> None:
    r = run_cli("verify", str(single), "--json")
    assert r.code == 0, r.out
    result = json.loads(r.out)
    assert result["ok"] is True
    assert result["gates"] == ["manifest", "files", "config", "container", "inventory", "qparams", "graph", "derived"]
    assert result["rungs"]["2_reconstruction"]["failed"] == []
    assert result["rungs"]["3_operators"]["max_rel_kernel"] < 1e-5


# --------------------------------------------------------------------------- verify catches tampering


def test_flipped_byte_in_any_file_is_caught(single: Path, tmp_path: Path) -> None:
    names = sorted(p.name for p in single.iterdir())
    assert set(names) >= {"model.safetensors", "config.json", "graph.qir", MANIFEST}
    for name in names:
        art = tmp_path / name
        shutil.copytree(single, art)
        data = bytearray((art / name).read_bytes())
        data[len(data) // 2] ^= 0x01
        (art / name).write_bytes(bytes(data))
        error = verify_error(art)
        if name == MANIFEST:
            assert error.startswith(f"{MANIFEST}: ")
        else:
            assert error.startswith(f"{name}: sha256: content differs from the manifest (expected ")


def test_missing_shard_is_caught(sharded: Path, tmp_path: Path) -> None:
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) >= 2
    art = copy(sharded, tmp_path)
    (art / shards[1]).unlink()
    assert verify_error(art) == f"{shards[1]}: listed in the manifest but missing"
    rehash(art)  # even with a manifest that agrees, the index still names the shard
    error = verify_error(art)
    assert error.startswith("model.safetensors.index.json: weight_map: shard named by the index is missing")
    assert error.endswith(f"(expected an existing shard file, found {shards[1]})")


def test_index_pointing_at_the_wrong_shard_is_caught(sharded: Path, tmp_path: Path) -> None:
    art = copy(sharded, tmp_path)
    index_path = art / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    tensor, shard = next(iter(sorted(index["weight_map"].items())))
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != shard)
    index["weight_map"][tensor] = other
    index_path.write_text(json.dumps(index, indent=2))
    rehash(art)
    assert verify_error(art) == (
        f"model.safetensors.index.json: tensor '{tensor}': weight_map: weight_map points at the wrong shard "
        f"(expected {shard}, found {other})"
    )


def test_total_size_must_be_tensor_bytes(sharded: Path, tmp_path: Path) -> None:
    art = copy(sharded, tmp_path)
    index_path = art / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    total = index["metadata"]["total_size"]
    index["metadata"]["total_size"] = sum(p.stat().st_size for p in art.glob("model-*.safetensors"))
    index_path.write_text(json.dumps(index, indent=2))
    rehash(art)
    error = verify_error(art)
    assert error.startswith("model.safetensors.index.json: metadata.total_size: is not the sum of tensor bytes")
    assert f"(expected {total}, found" in error


def test_scale_grouped_along_the_wrong_axis_is_caught(single: Path, tmp_path: Path) -> None:
    art = copy(single, tmp_path)
    f = open_file(art / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight_scale"
    tensors = []
    for t, e in f.tensors.items():
        data = f.read(t)
        shape = e.shape
        if t == name:  # the same 128 scales, stored [groups, out]: grouped along the output axis
            data = f.array(t).T.copy().tobytes()
            shape = (e.shape[1], e.shape[0])
        tensors.append(TensorBytes(t, e.dtype, shape, data))
    (art / "model.safetensors").write_bytes(b"".join(serialize(tensors, f.metadata)))
    rehash(art)
    assert verify_error(art) == (
        f"model.safetensors: tensor '{name}': shape: wrong shape ([out, in/32]: groups of 32 along the input axis) "
        "(expected [64, 2], found [2, 64])"
    )


def test_unlisted_file_and_symlink_are_refused(single: Path, tmp_path: Path) -> None:
    art = copy(single, tmp_path)
    (art / "extra.bin").write_bytes(b"x")
    assert verify_error(art) == "extra.bin: file is not listed in the manifest"
    (art / "extra.bin").unlink()
    (art / "config.json").rename(art / "real.json")
    (art / "config.json").symlink_to(art / "real.json")
    assert verify_error(art).startswith("config.json: is a symbolic link")


def test_quantization_status_must_say_compressed(single: Path, tmp_path: Path) -> None:
    art = copy(single, tmp_path)
    config = json.loads((art / "config.json").read_text())
    del config["quantization_config"]["quantization_status"]
    (art / "config.json").write_text(json.dumps(config))
    rehash(art)
    assert verify_error(art).startswith(
        "config.json: quantization_config.quantization_status: must say the weights are compressed"
    )


def test_reader_errors_are_typed(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="not an artifact directory"):
        open_artifact(tmp_path / "nothing")
    (tmp_path / MANIFEST).write_text('{"a": 1, "a": 2}')
    with pytest.raises(ArtifactError, match="duplicate key 'a'"):
        open_artifact(tmp_path)


# --------------------------------------------------------------------------- CLI contract


def test_inspect_reports_every_section(single: Path) -> None:
    r = run_cli("inspect", str(single), "--json")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    versions = info["versions"]
    for key in ("container", "artifact_schema", "quant_representation", "packing_layout", "graph", "tested_runtime"):
        assert key in versions
    assert versions["required_kernels"] == []
    assert info["provenance"]["converter"]["name"] == "qcompiler"
    assert len(info["provenance"]["source_sha256"]) == 64
    assert info["topology"]["tp"] == 1
    scopes = {s["scope"]: s for s in info["rate_ledger"]["scopes"]}
    assert scopes["codes only"]["bits_per_weight"] == 4.0
    assert scopes["codes + qparams"]["bits_per_weight"] == 5.0  # one f32 scale per 32 weights
    assert "whole artifact (every file byte over every parameter)" in scopes
    d = info["descriptors"][0]
    assert d["layout"] == "ct-pack-quantized/v1 offset-binary-lsb"
    assert d["codes"] == "i4[-8:7]"
    assert {e["tensor"] for e in info["inventory"]} >= {
        "model.layers.0.self_attn.q_proj.weight_packed",
        "lm_head.weight",
    }
    text = run_cli("inspect", str(single))
    assert text.code == 0
    assert "rate ledger" in text.out
    assert "codes + qparams" in text.out


def test_compile_usage_errors(tmp_path: Path) -> None:
    r = run_cli("compile", LLAMA, "--target", "safetensors")
    assert r.code == 1
    assert "--target needs -o OUT" in r.err
    r = run_cli("compile", LLAMA, "--target", "tflite", "-o", str(tmp_path / "x"))
    assert r.code == 1
    assert "unknown target 'tflite' (known: gguf, onnx, onnx-nbits, onnx-qdq, safetensors, triton)" in r.err


def test_layer_count_is_bounded_before_building_the_architecture(single: Path, tmp_path: Path) -> None:
    art = copy(single, tmp_path)
    config = json.loads((art / "config.json").read_text())
    config["num_hidden_layers"] = 10**9
    (art / "config.json").write_text(json.dumps(config))
    rehash(art)
    assert verify_error(art).startswith("config.json: num_hidden_layers: must be an integer in 1..")


def test_an_inventory_is_built_once_per_config_and_still_bounded(single: Path) -> None:
    """The writer's and the reopen's inventory of one config is built once; the layer bound is
    checked on every call, whoever built it first; the shared inventory cannot be changed."""
    from qcompiler.backends.safetensors.inventory import InventoryError, architecture_inventory

    config = json.loads((single / "config.json").read_text())
    first = architecture_inventory(config)
    assert architecture_inventory(dict(config)) is first
    with pytest.raises(InventoryError, match=r"must be an integer in 1\.\.") as e:
        architecture_inventory(config, max_layers=int(config["num_hidden_layers"]) - 1)
    assert e.value.field == "num_hidden_layers"
    with pytest.raises(TypeError):
        first.tensors["x"] = ((1,), "float32")  # pyright: ignore[reportIndexIssue]
    other = architecture_inventory({**config, "vocab_size": int(config["vocab_size"]) + 8})
    assert other is not first
    assert other.tensors["model.embed_tokens.weight"][0][0] == int(config["vocab_size"]) + 8

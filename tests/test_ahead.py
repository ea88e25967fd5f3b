"""The stream freezes and packs each weight ahead (``passes/ahead.py``) while it holds it; the passes
and the evidence on the reopened artifact take those facts instead of reading the weights again.
The artifact is the same byte for byte, and so is its parity record, with or without them; a weight
the facts do not cover (another consumer than predicted, a failure ahead) is done by the pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from qcompiler import ladder as ladder_module
from qcompiler.cli import compile as compile_cli
from qcompiler.cli.main import main
from qcompiler.errors import QcError
from qcompiler.examples import tiny_llama_hf
from qcompiler.passes import ahead as ahead_module
from qcompiler.passes import freeze_semantics, pack_layouts

FILES = ("model.safetensors", "graph.qir", "config.json")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ahead") / "src"
    tiny_llama_hf().save_pretrained(path)  # pyright: ignore[reportCallIssue]
    return path


def compile_to(src: Path, out: Path) -> dict[str, Any]:
    assert main(["compile", str(src), "--scheme", "w4-g32", "--target", "safetensors", "-o", str(out), "-q"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    return {"files": {f: (out / f).read_bytes() for f in FILES}, "parity": manifest["parity"]}


def counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[str]:
    calls: list[str] = []
    real = getattr(module, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.fixture(scope="module")
def without_ahead(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compile_cli, "ahead_for", lambda spec, target, proofs: None)  # pyright: ignore[reportUnknownLambdaType]
        return compile_to(llama_dir, tmp_path_factory.mktemp("no-ahead") / "out")


def test_the_passes_and_the_ladder_take_the_facts_proven_ahead(
    llama_dir: Path, without_ahead: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proved = counting(monkeypatch, freeze_semantics, "prove_weight")
    packed = counting(monkeypatch, pack_layouts, "pack_exact")
    checked = counting(monkeypatch, ladder_module, "check_whole") + counting(monkeypatch, ladder_module, "check_rows")
    got = compile_to(llama_dir, tmp_path / "out")
    assert (proved, packed, checked) == ([], [], [])
    assert got["files"] == without_ahead["files"]
    assert got["parity"] == without_ahead["parity"]


def test_a_weight_whose_consumer_was_predicted_otherwise_is_frozen_by_the_pass(
    llama_dir: Path, without_ahead: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(ahead_module.REQUIREMENTS, "QuantLinear", "any")
    proved = counting(monkeypatch, freeze_semantics, "prove_weight")
    got = compile_to(llama_dir, tmp_path / "out")
    assert proved  # every linear's weight is proven again by freeze-semantics
    assert got["files"] == without_ahead["files"]
    assert got["parity"] == without_ahead["parity"]


def test_a_failure_ahead_is_left_to_the_pass(
    llama_dir: Path, without_ahead: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fails(*args: Any, **kwargs: Any) -> None:
        raise QcError("the stream could not freeze this weight")

    monkeypatch.setattr(ahead_module.Ahead, "freeze", fails)
    proved = counting(monkeypatch, freeze_semantics, "prove_weight")
    got = compile_to(llama_dir, tmp_path / "out")
    assert proved
    assert got["files"] == without_ahead["files"]
    assert got["parity"] == without_ahead["parity"]


def test_logical_codes_packed_ahead_are_made_again_where_read(llama_dir: Path, tmp_path: Path) -> None:
    """The stream stores a packed weight's logical codes as a recipe (``blobs.derived``): never written
    to the spill, made from the packed codes, hash checked, when something reads them (``--dump-ir``)."""
    from qcompiler.ir.blobs import read_array
    from qcompiler.ir.parser import parse_module

    out, dump = tmp_path / "out", tmp_path / "dump"
    argv = ["compile", str(llama_dir), "--scheme", "w4-g32", "--target", "safetensors", "-o", str(out), "-q"]
    assert main([*argv, "--dump-ir", str(dump)]) == 0
    frozen = next(dump.glob("*freeze-semantics.qir"))
    m = parse_module(frozen.read_text(), str(frozen))
    m.base_dir = str(dump)
    codes = [n for n in m.tensors if n.endswith(".codes")]
    assert codes
    for name in codes:
        assert read_array(m, name).dtype.name == "int8"  # the dump's bytes, checked against the sha256


def test_every_dump_of_a_streamed_compile_reads_back_with_its_bytes(llama_dir: Path, tmp_path: Path) -> None:
    """``--dump-ir`` of a streamed compile: each file verifies with its data from the dump directory
    alone, the dense tensors that live in the source's shards copied beside it (content-addressed)."""
    from qcompiler.ir.parser import parse_module
    from qcompiler.ir.verifier import verify_module

    out, dump = tmp_path / "out", tmp_path / "dump"
    argv = ["compile", str(llama_dir), "--scheme", "w4-g32", "--target", "safetensors", "-o", str(out), "-q"]
    assert main([*argv, "--dump-ir", str(dump)]) == 0
    files = sorted(dump.glob("*.qir"))
    assert len(files) >= 7  # the input, then one per pass
    for f in files:
        m = parse_module(f.read_text(), str(f))
        m.base_dir = str(dump)
        assert all(d.blob.location.startswith("file:blobs/") for d in m.tensors.values()), f.name
        verify_module(m, data=True)

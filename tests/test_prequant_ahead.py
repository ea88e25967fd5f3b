"""A pre-quantized checkpoint's layers are frozen and packed where they are read
(``Ahead.prequantized``, called by ``backends/safetensors/prequant.py``): the format's decode is made
once per layer, hashed as the op's ``effective`` operand, and the proof that our descriptor decodes to
it runs right there, so the lowering never decodes and freeze-semantics and pack-layouts take the
facts instead of reading the layer again. The artifact and its parity record are the same byte for
byte with and without those facts and for any ``--jobs``; a layer whose proof fails ahead is proven
by the pass, which reports the mismatch; an act-order layer is left to the pass. With a spill
directory the layers are read while a forked child exports the model on their stand-ins; a real
module unlike its stand-in makes the export run in this process instead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_ahead import counting
from test_prequant_act_order import write_gptq_act_order
from test_prequant_sources import write_compressed_tensors, write_quantized

from qcompiler import api
from qcompiler.backends.safetensors import prequant_formats
from qcompiler.cli import compile as compile_cli
from qcompiler.cli.main import main
from qcompiler.errors import QcError
from qcompiler.frontend import stand_ins
from qcompiler.passes import ahead as ahead_module
from qcompiler.passes import freeze_semantics, pack_layouts
from qcompiler.testing import run_cli

FILES = ("model.safetensors", "graph.qir", "config.json")


def compile_to(src: Path, out: Path, *extra: str) -> dict[str, Any]:
    assert main(["compile", str(src), "--target", "safetensors", "-o", str(out), "-q", *extra]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    return {"files": {f: (out / f).read_bytes() for f in FILES}, "parity": manifest["parity"]}


@pytest.fixture(scope="module")
def ct_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ct") / "src"
    write_compressed_tensors(path, "pack-quantized", 4, 32, sym=False)  # zero points too
    return path


@pytest.fixture(scope="module")
def without_ahead(ct_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compile_cli, "ahead_for", lambda spec, target, proofs: None)  # pyright: ignore[reportUnknownLambdaType]
        return compile_to(ct_dir, tmp_path_factory.mktemp("no-ahead") / "out", "-j", "1")


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_each_layer_is_decoded_once_and_proven_where_it_is_read(
    ct_dir: Path, without_ahead: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jobs: str
) -> None:
    proved = counting(monkeypatch, freeze_semantics, "prove_weight")
    packed = counting(monkeypatch, pack_layouts, "pack_exact")
    decoded = counting(monkeypatch, prequant_formats, "ct_reference")
    got = compile_to(ct_dir, tmp_path / "out", "-j", jobs)
    assert (proved, packed) == ([], [])
    assert len(decoded) == len(got["parity"]["rung3_operators"]) == 14  # 2 layers x 7 linears, once each
    assert got["files"] == without_ahead["files"]
    assert got["parity"] == without_ahead["parity"]


def test_a_decode_that_differs_is_reported_by_the_pass(
    ct_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The format's decode of one layer made one ulp off (as a broken translation would make our
    codes disagree with it): the proof ahead fails, and freeze-semantics proves the layer itself and
    stops, naming the tensor, instead of the mismatch being lost."""
    real = prequant_formats.ct_reference

    def off_by_one_ulp(*args: Any) -> np.ndarray:
        out = real(*args).copy()
        if out.shape == (128, 128):  # q_proj and o_proj of the tiny Llama
            out.view(np.uint32)[3, 5] += 1
        return out

    monkeypatch.setattr(prequant_formats, "ct_reference", off_by_one_ulp)
    proved = counting(monkeypatch, freeze_semantics, "prove_weight")
    res = run_cli("compile", str(ct_dir), "--target", "safetensors", "-o", str(tmp_path / "out"), "-q")
    assert res.code != 0
    said = " ".join((res.out + res.err).split())
    assert "reference decode differs from the source's effective weight at [3, 5]" in said, said
    assert "tensor @model.layers.0.self_attn.q_proj.weight" in said, said
    assert proved
    assert not (tmp_path / "out").exists()


def test_a_failure_ahead_is_left_to_the_pass(
    ct_dir: Path, without_ahead: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fails(*args: Any, **kwargs: Any) -> None:
        raise QcError("could not freeze this layer where it was read")

    monkeypatch.setattr(ahead_module.Ahead, "freeze", fails)
    proved = counting(monkeypatch, freeze_semantics, "prove_weight")
    got = compile_to(ct_dir, tmp_path / "out", "-j", "2")
    assert len(proved) == 14
    assert got["files"] == without_ahead["files"]
    assert got["parity"] == without_ahead["parity"]


def test_gptq_layers_are_frozen_where_they_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    write_quantized(src, "gptq", 4, 32, sym=False)
    proved = counting(monkeypatch, freeze_semantics, "prove_weight")
    got = compile_to(src, tmp_path / "out", "-j", "2")
    assert proved == []
    assert len(got["parity"]["rung2_reconstruction"]["decode_blake3"]) == 14


def test_an_act_order_layer_is_proven_by_the_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPTQ ``desc_act`` layer (its ``g_idx`` a shuffled order of groups) is not frozen ahead (the
    hook takes codes in group order only): freeze-semantics proves it against the decode the source
    hashed as it read the layer, made again from its recipe and checked against that sha256."""
    src = tmp_path / "src"
    write_gptq_act_order(src, "gptq", 4, 32, sym=False)
    proved = counting(monkeypatch, freeze_semantics, "prove_weight")
    decoded = counting(monkeypatch, prequant_formats.gptq_awq, "reference")
    assert main(["compile", str(src), "--target", "triton", "-o", str(tmp_path / "out"), "-q", "-j", "2"]) == 0
    assert len(proved) == 14
    assert len(decoded) == 28  # where the layer is read, and again where the pass reads its recipe


def test_the_layers_are_read_beside_the_export_in_a_child(
    ct_dir: Path, without_ahead: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a spill directory (the CLI's), the model stands ready on stand-ins before any layer is
    read, a forked child exports it while this process reads the layers, and the child's module is
    used: nothing is captured in this process, and the artifact is the same."""
    captured_here = counting(monkeypatch, api, "capture")
    got = compile_to(ct_dir, tmp_path / "out", "-j", "2")
    assert captured_here == []
    assert got["files"] == without_ahead["files"]
    assert got["parity"] == without_ahead["parity"]


def test_a_module_unlike_its_stand_in_is_captured_here(
    ct_dir: Path, without_ahead: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stand_ins, "same_module", lambda stand, real: False)  # pyright: ignore[reportUnknownLambdaType]
    captured_here = counting(monkeypatch, api, "capture")
    got = compile_to(ct_dir, tmp_path / "out", "-j", "2")
    assert captured_here == ["capture"]
    assert got["files"] == without_ahead["files"]
    assert got["parity"] == without_ahead["parity"]

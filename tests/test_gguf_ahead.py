"""A quantized ``.gguf`` compiled as it is reads its layers like a pre-quantized directory: in ``--jobs``
threads, beside a forked child that exports the model on their stand-ins, each Q8_0/Q4_0/Q5_0 layer
frozen and packed where it is read (``Work.ahead``), so freeze-semantics and pack-layouts take the
facts instead of reading it again. The artifact and its parity record are the same byte for byte with
and without those facts and for any ``--jobs``; a K-quant layer (no affine codes) is left to the
passes, and a model whose layers have biases (BERT) is read in two threads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_ahead import counting

from qcompiler import api
from qcompiler.backends.gguf.ggml_types import GGMLType
from qcompiler.backends.gguf.reader import open_gguf
from qcompiler.backends.gguf.source import Importer
from qcompiler.cli import compile as compile_cli
from qcompiler.cli.main import main
from qcompiler.passes import freeze_semantics, pack_layouts

WIDE = "qcompiler.examples:tiny_llama_wide_hf"  # hidden 256, tied embeddings
FILES = ("model.gguf", "graph.qir")


def gguf_of(tmp: Path, scheme: str, src: str = WIDE) -> Path:
    out = tmp / f"{scheme}-src"
    assert main(["compile", src, "--scheme", scheme, "--target", "gguf", "-o", str(out), "-q"]) == 0
    return out / "model.gguf"


def compile_to(src: Path, out: Path, *extra: str) -> dict[str, Any]:
    assert main(["compile", str(src), "--target", "gguf", "-o", str(out), "-q", *extra]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    return {"files": {f: (out / f).read_bytes() for f in FILES}, "parity": manifest["parity"]}


@pytest.fixture(scope="module")
def q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gguf_of(tmp_path_factory.mktemp("q8"), "q8_0")


@pytest.fixture(scope="module")
def without_ahead(q8: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compile_cli, "ahead_for", lambda spec, target, proofs: None)  # pyright: ignore[reportUnknownLambdaType]
        return compile_to(q8, tmp_path_factory.mktemp("no-ahead") / "out", "-j", "1")


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_q8_0_layers_are_frozen_and_packed_where_they_are_read(
    q8: Path, without_ahead: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jobs: str
) -> None:
    proved = counting(monkeypatch, freeze_semantics, "prove_weight")
    packed = counting(monkeypatch, pack_layouts, "pack_exact")
    captured_here = counting(monkeypatch, api, "capture")
    read = counting(monkeypatch, Importer, "quantized")
    got = compile_to(q8, tmp_path / "out", "-j", jobs)
    assert (proved, packed, captured_here) == ([], [], [])  # facts taken; the child's module used
    f = open_gguf(q8)
    quantized = [t for t in f.tensors.values() if t.type_id == GGMLType.Q8_0]
    assert len(quantized) == 14  # 2 layers x 7 linears (the table stays dense)
    assert len({t.shape for t in quantized}) == 4
    assert len(read) == 14 + 4  # each layer read once, after one per kind stood the model up
    assert got["files"] == without_ahead["files"]
    assert got["parity"] == without_ahead["parity"]
    assert got["files"]["model.gguf"] == q8.read_bytes()  # and the re-emit is still the source file


def test_k_quant_layers_are_left_to_the_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = gguf_of(tmp_path, "q4_k_m")
    proved = counting(monkeypatch, freeze_semantics, "prove_blocks")
    got = compile_to(src, tmp_path / "out", "-j", "2")
    assert len(got["parity"]["rung3_operators"]) == 14  # 2 layers x 7 linears
    assert len(proved) == 15  # each of them and the tied table, by the pass
    assert got["files"]["model.gguf"] == src.read_bytes()


def test_a_model_with_biases_is_read_in_two_threads(tmp_path: Path) -> None:
    """BERT's linears have biases: each worker hands the quantized module a meta bias, not the
    streamed model's fake one (a fake tensor computed with in two threads at once fails)."""
    src = gguf_of(tmp_path, "q8_0", "qcompiler.examples:tiny_bert_hf")
    one = compile_to(src, tmp_path / "one", "-j", "1")
    two = compile_to(src, tmp_path / "two", "-j", "2")
    assert one["files"] == two["files"]
    assert two["files"]["model.gguf"] == src.read_bytes()


def test_recipes_of_layers_with_biases_are_read_in_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's codes kept as a recipe (``blobs.derived``) are made again by whichever thread reads
    them (the graph probe's, a pass's worker): each rebuilds the quantized module from a meta bias,
    so BERT's layers read in four threads at once give their bytes back."""
    from concurrent.futures import ThreadPoolExecutor

    from qcompiler.backends.gguf.source import load_gguf_source
    from qcompiler.frontend import rebuilt
    from qcompiler.ir.blobs import read_blob, spilled
    from qcompiler.ir.core import BlobRef, TensorDecl

    src = gguf_of(tmp_path, "q8_0", "qcompiler.examples:tiny_bert_hf")
    monkeypatch.setattr(rebuilt, "DERIVED_BYTES", 0)  # every buffer a recipe
    with spilled(tmp_path / "spill"):
        cap = load_gguf_source(str(src))
        assert cap.lazy is not None
        if cap.reading is not None:
            assert cap.reading.read()
        codes = {n: r for n, r in cap.lazy.items() if n.endswith(".codes")}
        assert len(codes) >= 12
        refs = list(codes.values()) * 4

        def read(ref: BlobRef) -> bytes | memoryview:
            return read_blob(TensorDecl("codes", ref))

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(read, refs))
    assert all(len(b) == r.nbytes for b, r in zip(got, refs, strict=True))

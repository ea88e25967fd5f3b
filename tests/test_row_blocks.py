"""Huge weights checked a block of rows at a time (``ir.row_blocks``, ``parity_rows``) give the
same answers as the whole-weight checks.

The block budgets are made small here so that the tiny models' weights are "huge": the ggml codecs'
chunked ``split``/``dequantize``/``join`` and the K-quant code layout's chunked pack/unpack equal one
whole call; on reopened artifacts of every target the
sliced ladder's rung 1 verdicts, decode sha256s, rung 2 verdicts and messages (a difference past
the first block named by its absolute row) and rung 3 norms equal the whole-weight ladder's; and
re-emitting a K-quant GGUF source with the freeze proof done block by block writes the same file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from qcompiler.artifact.evidence import probe_inputs
from qcompiler.artifact.reader import open_artifact
from qcompiler.backends.gguf import codecs
from qcompiler.backends.gguf.ggml_types import GGMLType
from qcompiler.backends.gguf.quant_blocks import describe_blocks
from qcompiler.ir import row_blocks
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.interpret import RULES, run_graph
from qcompiler.ir.layouts import find_layout
from qcompiler.ir.types import PackSpec
from qcompiler.ladder import Ladder, ladder
from qcompiler.parity import decoded, pack_round_trip, parts, weights
from qcompiler.report import KERNEL_TOLERANCE
from qcompiler.testing import run_cli

UNTIED = "qcompiler.examples:tiny_llama_wide_untied_hf"  # hidden 256, untied head
SMALL_BLOCK = 4096  # elements: 16 rows of a 256-wide weight

CODEC_TYPES = [
    GGMLType.Q8_0,
    GGMLType.Q4_0,
    GGMLType.Q4_1,
    GGMLType.Q5_0,
    GGMLType.Q5_1,
    GGMLType.Q4_K,
    GGMLType.Q5_K,
    GGMLType.Q6_K,
    GGMLType.TQ1_0,
    GGMLType.TQ2_0,
]


@pytest.mark.parametrize("ggml", CODEC_TYPES, ids=lambda t: t.name)
def test_chunked_split_and_dequantize_equal_one_whole_call(ggml: GGMLType, monkeypatch: pytest.MonkeyPatch) -> None:
    codec = codecs.get_codec(ggml)
    rows = np.random.default_rng(int(ggml)).standard_normal((37, 512)).astype(np.float32)
    blob = codec.quantize(rows)
    whole_parts, whole = codec.split(blob), codec.dequantize(blob)
    monkeypatch.setattr(codecs, "SPLIT_CHUNK", 3 * 512)  # 3 rows a chunk, the last one short
    chunked_parts, chunked = codec.split(blob), codec.dequantize(blob)
    assert list(chunked_parts) == list(whole_parts)
    for name, a in whole_parts.items():
        assert chunked_parts[name].dtype == a.dtype, name
        assert np.array_equal(chunked_parts[name], a), name
    assert np.array_equal(chunked.view(np.uint32), whole.view(np.uint32))
    assert codec.join(chunked_parts).tobytes() == blob.tobytes()


K_ENCODINGS = {GGMLType.Q4_K: "q4_k", GGMLType.Q5_K: "q5_k", GGMLType.Q6_K: "q6_k", GGMLType.TQ2_0: "tq2_0"}


@pytest.mark.parametrize("ggml", sorted(K_ENCODINGS), ids=lambda t: t.name)
def test_k_quant_code_layout_packs_slices_of_rows_as_it_packs_the_whole(
    ggml: GGMLType, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = codecs.get_codec(ggml)
    rows = np.random.default_rng(int(ggml)).standard_normal((37, 512)).astype(np.float32)
    t, arrays = describe_blocks(ggml.name, codec.split(codec.quantize(rows)), DTYPES["f32"])
    t = dataclasses.replace(t, pack=PackSpec("ggml-k", 1, K_ENCODINGS[ggml], (1, 256)))
    layout = find_layout("ggml-k", 1)
    assert layout is not None
    codes = arrays["codes"]
    assert isinstance(codes, np.ndarray)
    whole = layout.pack(codes, t)
    monkeypatch.setattr(codecs, "SPLIT_CHUNK", 2 * 512)
    assert np.array_equal(layout.pack(codes, t), whole)
    assert np.array_equal(layout.unpack(whole, t), codes)


TARGETS = {
    "safetensors": ("--scheme", "w4-g128"),
    "gguf": ("--scheme", "q4_k_m"),
    "onnx-nbits": ("--scheme", "w4-g32"),
    "onnx": ("--scheme", "w4-g32"),
    "triton": ("--scheme", "w4-g32"),
}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rows")
    out: dict[str, Path] = {}
    for target, args in TARGETS.items():
        out[target] = root / target
        r = run_cli("compile", UNTIED, "--target", target, *args, "-o", str(out[target]), "--quiet")
        assert r.code == 0, r.err
    return out


def whole_decodes(m: Any) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, op, t in weights(m):
        codes = parts(m, {"codes": op.attrs["codes"]})["codes"]
        assert isinstance(codes, np.ndarray)
        out[name] = decoded(m, op, t, pack_round_trip(codes, t)[1])
    return out


def assert_same_ladders(sliced: Ladder, whole: Ladder) -> None:
    assert [(r.tensor, r.ok) for r in sliced.r1] == [(r.tensor, r.ok) for r in whole.r1]
    assert all(r.ok for r in whole.r1)
    assert sliced.decode_digests == whole.decode_digests
    assert [(r.tensor, r.ok, r.detail) for r in sliced.r2] == [(r.tensor, r.ok, r.detail) for r in whole.r2]
    assert [r.tensor for r in sliced.r3] == [r.tensor for r in whole.r3]
    for a, b in zip(sliced.r3, whole.r3, strict=True):
        assert a.metrics.keys() == b.metrics.keys()
        for k, v in b.metrics.items():
            if "kernel" in k:  # float32 linear of a block of output columns rounds differently: same scale
                assert a.metrics[k] <= 10 * v + 1e-9, (a.tensor, k)
                assert v <= 10 * a.metrics[k] + 1e-9, (a.tensor, k)
                assert a.metrics["rel_kernel"] < KERNEL_TOLERANCE, a.tensor
            else:
                assert a.metrics[k] == pytest.approx(v, rel=1e-6, abs=1e-12), (a.tensor, k)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_the_sliced_ladder_equals_the_whole_one(
    target: str, artifacts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    m = open_artifact(artifacts[target]).module
    effective = whole_decodes(m)
    rng = np.random.default_rng(0)  # float weights near the decode: rung 3's quantization error is not zero
    floats = {k: torch.from_numpy(v + rng.normal(0, 1e-3, v.shape).astype(np.float32)) for k, v in effective.items()}
    whole = ladder(m, effective, floats, jobs=2)
    assert not any(row_blocks.huge(t) for _, _, t in weights(m))
    monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", SMALL_BLOCK)
    huge = [name for name, _, t in weights(m) if row_blocks.huge(t)]
    assert len(huge) >= 2, f"{target}: no weight is sliced"
    sliced = ladder(m, effective, floats, jobs=2)
    assert_same_ladders(sliced, whole)
    assert sliced.r2
    assert all(r.ok for r in sliced.r2)

    # a reference that differs past the first block: the same verdict, the row named absolutely
    name = huge[-1]
    bad = dict(effective)
    bad[name] = effective[name].copy()
    row = effective[name].shape[0] - 3
    bad[name][row, 5] += 1.0
    flagged = [r for r in ladder(m, bad, None, jobs=1).r2 if not r.ok]
    monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", 1 << 23)
    expected = [r for r in ladder(m, bad, None, jobs=1).r2 if not r.ok]
    assert [(r.tensor, r.detail) for r in flagged] == [(r.tensor, r.detail) for r in expected]
    assert flagged[0].tensor == name
    assert f"[{row}, 5]" in flagged[0].detail
    assert flagged[0].metrics["max_abs_diff"] == pytest.approx(expected[0].metrics["max_abs_diff"])


def test_a_k_quant_source_proven_block_by_block_reemits_the_same_file(
    artifacts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """freeze-semantics proves each ggml weight of a GGUF source against the source's dequantize a
    block of rows at a time when it is huge; the bytes it freezes are the same."""
    monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", SMALL_BLOCK)
    src = artifacts["gguf"] / "model.gguf"
    again = tmp_path / "again"
    r = run_cli("compile", str(src), "--target", "gguf", "-o", str(again), "--quiet")
    assert r.code == 0, r.err
    assert (again / "model.gguf").read_bytes() == src.read_bytes()
    assert run_cli("verify", str(again)).code == 0


@pytest.mark.parametrize("target", ["gguf", "safetensors"])
def test_the_interpreter_decodes_huge_weights_by_rows_to_the_same_logits(
    target: str, artifacts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graph probe's interpreter keeps a huge weight's decode unexpanded (``ir.lazy.Decoded``):
    the embedding gathers its rows, the head decodes a block of rows at a time; the logits are the
    whole-decode ones, bit for bit."""
    m = open_artifact(artifacts[target]).module
    inputs = probe_inputs(m)
    assert inputs is not None
    whole = run_graph(m, inputs)[0]
    monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", SMALL_BLOCK)
    seen: list[str] = []
    weight_rule = RULES["q.weight"]

    def spy(env: Any, op: Any, xs: list[Any]) -> Any:
        out = weight_rule(env, op, xs)
        seen.append(type(out).__name__)
        return out

    monkeypatch.setitem(RULES, "q.weight", spy)
    sliced = run_graph(m, inputs)[0]
    assert "Decoded" in seen
    assert torch.equal(sliced, whole)

"""The graph probe binds graph.qir's meaning, not only its tensors: ``verify`` reruns the graph on the
seeded probe input and requires the output recorded at compile time. An edit the tensor hashes cannot
see (an epsilon, an op, an attribute), with the manifest's file list re-hashed as a careless tool
would, is refused; the untouched artifact passes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qcompiler.artifact.writer import MANIFEST
from qcompiler.testing import rehash, run_cli


def compiled(tmp_path_factory: pytest.TempPathFactory, factory: str) -> Path:
    out = tmp_path_factory.mktemp("probe") / "art"
    r = run_cli(
        "compile", f"qcompiler.examples:{factory}", "--scheme", "w4-g32", "--target", "safetensors", "-o", str(out)
    )
    assert r.code == 0, r.err
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compiled(tmp_path_factory, "tiny_llama_hf")


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compiled(tmp_path_factory, "tiny_bert_hf")


def verify(path: Path) -> dict[str, object]:
    r = run_cli("verify", str(path), "--json")
    return json.loads(r.out)


def edited(src: Path, tmp_path: Path, old: str, new: str, count: int = 1) -> Path:
    art = tmp_path / "art"
    shutil.copytree(src, art)
    text = (art / "graph.qir").read_text()
    assert old in text
    (art / "graph.qir").write_text(text.replace(old, new, count))
    rehash(art)
    return art


def test_probe_is_recorded_and_passes(llama: Path, bert: Path) -> None:
    for art in (llama, bert):
        manifest = json.loads((art / MANIFEST).read_text())
        probe = manifest["parity"]["graph_probe"]
        assert len(probe["projections"]) == 8
        assert probe["norm"] > 0
        result = verify(art)
        assert result["ok"] is True, result
        assert result["rungs"]["3_graph_probe"]["failed"] == []  # type: ignore[index]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("value = 1e-06", "value = 1e-05"),  # rms-norm epsilon of the first norm
        ("%neg = neg(%slice_1)", "%neg = relu(%slice_1)"),  # rotary half sign
        ("{axis = 3, start = 0, end = 8, step = 1}", "{axis = 3, start = 0, end = 8, step = 2}"),
        ("value = 2.0", "value = 1.0"),  # rms-norm of mean(x), not mean(x^2): a NaN output
        ("value = 1e-06", "value = -inf"),  # a NaN output too: NaN never compares within tolerance
    ],
)
def test_semantic_edits_of_graph_qir_are_refused(llama: Path, tmp_path: Path, old: str, new: str) -> None:
    art = edited(llama, tmp_path, old, new)
    result = verify(art)
    assert result["ok"] is False
    assert "graph" in str(result["error"])


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("%transpose_2, %attn_mask) {causal = false", "%transpose_2) {causal = false"),  # mask dropped
        ("{causal = false, scale = 0.125}", "{causal = false, scale = 0.12}"),
    ],
)
def test_encoder_edits_are_refused(bert: Path, tmp_path: Path, old: str, new: str) -> None:
    """The probe's second row is padded, so even dropping the mask of one layer moves the output."""
    assert verify(edited(bert, tmp_path, old, new))["ok"] is False


@pytest.mark.parametrize("value", [10**21, 10**400, "0.1", True])
def test_a_malformed_recorded_probe_is_a_typed_refusal(llama: Path, tmp_path: Path, value: object) -> None:
    """A recorded projection that is no finite float (an int beyond float, a string, a bool), with the
    manifest's digest recomputed: a failed rung, not an OverflowError."""
    from qcompiler.artifact.writer import SELF_DIGEST, manifest_digest

    art = tmp_path / "art"
    shutil.copytree(llama, art)
    manifest = json.loads((art / MANIFEST).read_text())
    manifest["parity"]["graph_probe"]["projections"][4] = value
    manifest[SELF_DIGEST] = manifest_digest(manifest)
    (art / MANIFEST).write_text(json.dumps(manifest))
    r = run_cli("verify", str(art), "--json")
    assert r.code == 1, r.err
    assert "Traceback" not in r.err
    result = json.loads(r.out)
    assert result["ok"] is False
    assert "probe" in str(result["error"]) or "projections" in str(result["error"]), result


def test_a_graph_whose_probe_output_is_not_finite_fails_parity(tmp_path: Path) -> None:
    """At compile time a NaN probe would be written into the manifest as a NaN (which the strict
    reader refuses): it is a parity failure instead, and nothing is recorded."""
    import hashlib

    import numpy as np

    from qcompiler.artifact.evidence import gather
    from qcompiler.ir.parser import parse_module

    table = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
    (tmp_path / "e.bin").write_bytes(table.tobytes())
    digest = hashlib.sha256(table.tobytes()).hexdigest()
    text = f"""module @m {{
  tensor @e : f32[8,4] = blob<"sha256:{digest}", "file:e.bin">
  graph @g(%ids: tensor<i64[?b,?s]>) {{
    %t = const() {{ref = @e}} : tensor<f32[8,4]>
    %x = embedding(%t, %ids) : tensor<f32[?b,?s,4]>
    %inf = full() {{value = inf, shape = []}} : tensor<f32[]>
    %y = mul(%x, %inf) : tensor<f32[?b,?s,4]>
    %z = sub(%y, %y) : tensor<f32[?b,?s,4]>
    return(%z)
  }}
}}
"""
    m = parse_module(text)
    m.base_dir = str(tmp_path)
    record = gather(m, {})
    assert record["ok"] is False
    assert any("not finite" in f for f in record["failures"]), record["failures"]
    assert "graph_probe" not in record

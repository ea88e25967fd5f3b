"""A built-in scheme transfers between targets: ``--scheme w4-g32`` on an fp16 model stores f16
scales for compressed-tensors (the model dtype) and for GGUF (what Q4_0 holds), so both artifacts
hold the same codes and scales and decode to the same values bit for bit, weight by weight (read
back through each target's production reader)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from qcompiler.artifact.reader import open_artifact
from qcompiler.parity import decoded, weights
from qcompiler.testing import run_cli

FP16 = """
import torch

from qcompiler.examples import tiny_llama_hf


def model():
    return tiny_llama_hf().to(torch.float16)
"""


@pytest.fixture
def fp16_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "fp16_factory.py").write_text(FP16)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fp16_factory:model"
    sys.modules.pop("fp16_factory", None)


def decodes(path: Path) -> dict[str, np.ndarray]:
    m = open_artifact(path).module
    return {name: decoded(m, op, t) for name, op, t in weights(m)}


@pytest.mark.parametrize(("scheme", "ggml"), [("w4-g32", "Q4_0"), ("w8-g32", "Q8_0")])
def test_a_group_32_scheme_gives_the_same_weights_in_compressed_tensors_and_gguf(
    tmp_path: Path, fp16_factory: str, scheme: str, ggml: str
) -> None:
    out: dict[str, Path] = {}
    for target in ("safetensors", "gguf"):
        out[target] = tmp_path / target
        r = run_cli("compile", fp16_factory, "--scheme", scheme, "--target", target, "-o", str(out[target]))
        assert r.code == 0, r.err
        assert json.loads((out[target] / "manifest.json").read_text())["conversions"] == []
    ct, gg = decodes(out["safetensors"]), decodes(out["gguf"])
    assert set(ct) == set(gg)
    assert len(ct) == 14
    for name, values in ct.items():
        assert values.shape == gg[name].shape, name
        assert np.array_equal(values.view(np.uint32), gg[name].view(np.uint32)), name

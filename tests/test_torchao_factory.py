"""A factory returning a torchao-quantized model compiles through the CLI (``pkg.module:factory``):
its codes are adopted as they are (never requantized) and its source identity hashes what the
torchao tensors store (it used to die in ``state_sha256``: ``.numpy()`` is not supported for
tensor subclasses). transformers loads the compressed-tensors artifact and computes torchao's logits."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from qcompiler.testing import run_cli

FACTORY = """
import torch
from torchao.quantization import IntxWeightOnlyConfig, quantize_
from torchao.quantization.granularity import PerGroup
from torchao.quantization.quant_primitives import MappingType

from qcompiler.examples import tiny_llama_hf


def model(mapping=MappingType.SYMMETRIC):
    m = tiny_llama_hf().eval()
    quantize_(m, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32), mapping_type=mapping))
    return m


def model_asym():
    return model(MappingType.ASYMMETRIC)
"""


@pytest.fixture
def factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "ao_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "ao_factory"
    sys.modules.pop("ao_factory", None)


@pytest.mark.parametrize("attr", ["model", "model_asym"])
def test_a_torchao_factory_compiles_with_its_codes_and_transformers_gets_its_logits(
    tmp_path: Path, factory: str, attr: str
) -> None:
    import transformers

    out = tmp_path / "out"
    r = run_cli("compile", f"{factory}:{attr}", "--target", "safetensors", "-o", str(out))
    assert r.code == 0, r.err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["conversions"] == []
    assert manifest["parity"]["ok"]
    assert run_cli("verify", str(out)).code == 0
    again = tmp_path / "again"
    assert run_cli("compile", f"{factory}:{attr}", "--target", "safetensors", "-o", str(again)).code == 0
    source = manifest["provenance"]["source_sha256"]
    assert source == json.loads((again / "manifest.json").read_text())["provenance"]["source_sha256"]

    made = getattr(sys.modules[factory], attr)()
    ids = torch.tensor([[3, 17, 42, 5, 99, 1, 64, 7]])
    with torch.no_grad():
        want = made(input_ids=ids).logits.double()
        # dequantize=True: the compressed load of an asymmetric checkpoint is refused by transformers
        # itself (compressed-tensors 0.20.1 lays out the zero point unpacked; test_safetensors_backend)
        config = transformers.CompressedTensorsConfig(dequantize=True)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            out, local_files_only=True, quantization_config=config
        )
        got = theirs.eval()(input_ids=ids)
    err = float((got.logits.double() - want).abs().max())
    assert err <= 1e-4 * float(want.abs().max())

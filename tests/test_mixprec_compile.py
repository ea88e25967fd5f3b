"""``--scheme mixed-2416``: the scheme's spelling, the whole-model quantizer through the frontend and
``freeze-semantics`` (each weight's mixprec decode proven equal to its module's own dequantize), the
rate met over the model, calibration text, and the ``cpu.mixprec`` kernel against the reference decode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from qcompiler.ir import parse_module, print_module, verify_module
from qcompiler.ir.core import Module
from qcompiler.ir.descriptor import part_bits, rate_claim
from qcompiler.ir.types import QuantType
from qcompiler.parity import decoded
from qcompiler.quant.mixprec_module import PROVIDER, MixprecLinear, MixScheme, parse_mixed
from qcompiler.quant.schemes import SchemeError
from qcompiler.runtime.cpu_mixprec import KERNEL, prepare, run
from qcompiler.runtime.kernels import Place, admit, signature

FACTORY = "qcompiler.examples:tiny_llama_wide_hf"
ALL_IN = ("codes", "scale", "zero", "exceptions")


def qc(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("qcompiler")
    return subprocess.run([str(exe), *args], cwd=cwd, capture_output=True, text=True, env={**os.environ}, check=False)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("mixed-2416", MixScheme()),
        ("mixed-2416-g128-r2.8", MixScheme(group=128, rate=2.8)),
        ("mixed-2416-s32-o0.01-layers", MixScheme(group2=32, outliers=0.01, layers=True)),
    ],
)
def test_scheme_spelling(text: str, want: MixScheme) -> None:
    assert parse_mixed(text) == want


@pytest.mark.parametrize(
    ("text", "part"),
    [("mixed-2416-x3", "unknown part 'x3'"), ("mixed-2416-g24", "multiple of 16"), ("mixed-2416-r9", "rate")],
)
def test_scheme_errors_name_the_part(text: str, part: str) -> None:
    with pytest.raises(SchemeError, match=part):
        parse_mixed(text)


def test_layer_baseline_makes_each_weight_uniform() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 128))
    PROVIDER.quantize(model, "mixed-2416-g32-r3.5-layers", (), False, None)
    widths = set()
    for mod in model:
        if isinstance(mod, MixprecLinear):
            wide, rows = int(mod.get_buffer("wide").numel()), int(mod.get_buffer("wide_rows").numel())
            n4, groups = wide + rows * mod.in_features // 32, mod.out_features * mod.in_features // 32
            assert n4 in (0, groups)
            assert wide == 0  # a 4-bit weight is all rows: listed in wide_rows, not group by group
            assert int(mod.get_buffer("value").numel()) == 0
            widths.add(n4 == groups)
    assert widths == {True, False}  # 3.5 bits over the model, as stored: some weights 4-bit, some 2-bit


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Module:
    """The tiny Llama through the front half with ``mixed-2416`` (tensors written beside the IR)."""
    out = tmp_path_factory.mktemp("mix") / "m.qir"
    r = qc("compile", FACTORY, "--scheme", "mixed-2416", "-o", str(out), "-q", cwd=out.parent)
    assert r.returncode == 0, r.stderr
    m = parse_module(out.read_text())
    m.base_dir = str(out.parent)
    return m


def mix_weights(m: Module) -> list[tuple[str, QuantType]]:
    out = []
    for op in m.ops():
        t = op.results[0].quant if op.name == "q.weight" else None
        if t is not None:
            out.append((op.results[0].name, t))
    return out


def test_every_linear_is_frozen_as_mixprec_within_the_rate(front: Module) -> None:
    weights = mix_weights(front)
    assert len(weights) == 14  # 2 layers x 7 projections; the tied head is left float
    assert {t.family for _, t in weights} == {"mixprec"}
    bits = sum(rate_claim(t, ALL_IN).bits for _, t in weights)
    params = sum(int(t.shape[0]) * int(t.shape[1]) for _, t in weights)
    assert bits / params <= 3.0
    assert any(part_bits(t, "codes") > 2 * int(t.shape[0]) * int(t.shape[1]) for _, t in weights)  # 4-bit groups
    assert all(t.rate == rate_claim(t, ALL_IN) for _, t in weights)
    assert print_module(parse_module(print_module(front))) == print_module(front)
    verify_module(front, data=True)


def test_cpu_kernel_matches_the_reference_decode(front: Module) -> None:
    torch.manual_seed(1)
    for op in front.ops():
        if op.name != "q.linear":
            continue
        w = next(o for o in front.ops() if o.results and o.results[0] is op.operands[1])
        t = w.results[0].quant
        assert t is not None
        ok, why = admit(KERNEL, signature(op, t, "decode", Place()))
        assert ok, why
        h = prepare(front, w, t, Place())
        x = torch.randn(3, int(t.shape[1]))
        got = run(h, x, None).double()
        ref = x.double() @ torch.from_numpy(np.asarray(decoded(front, w, t), dtype=np.float64)).T
        assert float((got - ref).norm() / ref.norm()) < KERNEL.error_bound


def test_calibration_needs_the_mixed_scheme_and_a_tokenizer(tmp_path: Path) -> None:
    text = tmp_path / "calib.txt"
    text.write_text("one sentence\n")
    r = qc("compile", FACTORY, "--scheme", "w4-g32", "--calibration", str(text), "-o", "x.qir", cwd=tmp_path)
    assert r.returncode != 0
    assert "--calibration weighs a scheme's errors by activations" in r.stderr
    r = qc("compile", FACTORY, "--scheme", "mixed-2416", "--calibration", str(text), "-o", "x.qir", cwd=tmp_path)
    assert r.returncode != 0
    assert "needs the source's tokenizer" in r.stderr
    assert "Traceback" not in r.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    r = qc("compile", FACTORY, "--scheme", "mixed-2416", "--calibration", str(empty), "-o", "x.qir", cwd=tmp_path)
    assert "no text in it" in r.stderr


def test_run_and_verify_level_5_use_the_packed_cpu_kernel(tmp_path: Path) -> None:
    """The tiny Llama compiled to safetensors: ``qcompiler run`` with ``--fallback forbid`` selects
    ``cpu.mixprec`` for every quantized op in both phases, and ``verify --level 5`` (rung 4's greedy
    tokens against the reference decode, rung 5's dispatch) passes."""
    r = qc("compile", FACTORY, "--scheme", "mixed-2416", "--target", "safetensors", "-o", "a", "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = qc("run", "a", "--tokens", "1,2,3,4", "--max-new-tokens", "6", "--fallback", "forbid", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    ran = json.loads(r.stdout)
    assert ran["kernels"] == {"prefill": ["cpu.mixprec"], "decode": ["cpu.mixprec"]}
    assert ran["fallback_fraction"] == 0.0
    assert len(ran["generated"]) == 6
    r = qc("verify", "a", "--level", "5", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rungs = json.loads(r.stdout)["rungs"]
    assert rungs["4_graph_logits"]["greedy_equal"] is True
    assert rungs["5_dispatch_resources"]["kernels"] == ["cpu.mixprec"]
    assert rungs["5_dispatch_resources"]["fallbacks"] == 0

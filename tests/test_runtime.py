"""``qcompiler.load`` and the CPU runtime: every artifact kind loads through the reader gates, each
quantized op is admitted to a packed kernel (or refused under ``fallback="forbid"``), the dispatch trace
says why, and execution from the QIR graph (KV-cache decoding included) agrees with the reference."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import qcompiler
from qcompiler.artifact.manifest import rate_ledger
from qcompiler.ir.interpret import run_graph
from qcompiler.ir.parser import parse_module
from qcompiler.runtime import LoadError, Session, rungs
from qcompiler.testing import run_cli

LLAMA = "qcompiler.examples:tiny_llama_hf"
BERT = "qcompiler.examples:tiny_bert_hf"
PROMPT = [[5, 17, 99, 3], [3, 99, 17, 5]]


def build(tmp_path: Path, src: str, scheme: str, target: str) -> Path:
    out = tmp_path / f"{scheme}-{target}"
    r = run_cli("compile", src, "--scheme", scheme, "--target", target, "-o", str(out))
    assert r.code == 0, r.err
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(
    ("scheme", "target", "kernel"),
    [
        ("w4-g32", "safetensors", "cpu.int4pack"),  # the demo's artifact
        ("w8-channel", "safetensors", "cpu.int8pack"),
        ("q4_0", "gguf", "cpu.int4pack"),  # f16 scales, ggml code layout unpacked at load
        ("w4-g32", "onnx-nbits", "cpu.int4pack"),  # MatMulNBits bytes unpacked at load
    ],
)
def test_artifacts_load_with_fallback_forbidden_and_decode_like_the_reference(
    tmp_path: Path, scheme: str, target: str, kernel: str
) -> None:
    lm = qcompiler.load(build(tmp_path, LLAMA, scheme, target), fallback="forbid")
    assert lm.opened.gates[-1] == "derived"  # every reader gate ran first
    linears = [d for d in lm.decisions if d.op == "q.linear"]
    assert linears
    assert {d.phase for d in linears} == {"prefill", "decode"}
    assert {d.selected for d in linears} == {kernel}
    for d in linears:
        verdicts = {c[0]: c[1] for c in d.candidates}
        assert verdicts[kernel]
        assert not verdicts["cpu.reference"]  # only on request
    assert max(lm.self_check.values()) <= 1e-5
    assert set(lm.timeline) == {"discover", "parse", "verify", "place", "read", "transfer", "repack", "warmup"}
    session = Session(lm)
    tokens, steps = session.generate(PROMPT, 16)
    ids = torch.tensor(PROMPT)
    for i, logits in enumerate(steps):
        ref = run_graph(lm.module, [ids])[0][:, -1]
        assert rel(logits, ref) <= 1e-5, i
        nxt = ref.argmax(-1)
        assert nxt.tolist() == [row[i] for row in tokens], i
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    assert session.kernels_used == {"prefill": {kernel}, "decode": {kernel}}
    assert lm.memory["fallback_buffers"] == 0
    assert lm.memory["kv_cache"] == 2 * 2 * 2 * 2 * (4 + 15) * 16 * 4  # layers, k/v, batch, kv heads, tokens, dim, f32
    assert lm.memory["runtime_workspace"] > 2 * 4 * 128 * 4  # at least the prefill's logits


def test_bert_runs_on_int8pack_with_its_padding_mask(tmp_path: Path) -> None:
    lm = qcompiler.load(build(tmp_path, BERT, "w8-channel", "safetensors"))
    ids = torch.randint(0, 100, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[2, 5:] = 0
    got = Session(lm).run([ids, mask])[0]
    assert rel(got, run_graph(lm.module, [ids, mask])[0]) <= 1e-5
    assert {d.selected for d in lm.decisions} == {"cpu.int8pack"}


def test_a_layout_without_a_cpu_kernel_is_refused_or_reported(tmp_path: Path) -> None:
    """Q4_K's nested scales: no packed CPU kernel. ``forbid`` names the ops; ``warn`` loads, reports the
    fallback fraction of weighted work, and still computes the reference's logits."""
    out = build(tmp_path, "qcompiler.examples:tiny_llama_wide_hf", "q4_k", "gguf")
    with pytest.raises(LoadError, match=r"fallback='forbid': 14 op\(s\) .* q\.linear model\.layers\.0\.mlp\.down_proj"):
        qcompiler.load(out)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = qcompiler.load(out, fallback="warn")
    assert any("100.0% of weighted work" in str(w.message) for w in caught)
    assert lm.fallback_fraction() == 1.0
    d = lm.decision("model.layers.0.mlp.up_proj.weight", "prefill")
    assert d.selected == "cpu.dequant"
    assert {k: why for k, _, why in d.candidates}["cpu.int4pack"] == "family nested not in ['affine']"
    assert lm.memory["fallback_buffers"] > 0
    ids = torch.tensor(PROMPT)
    assert rel(Session(lm).step(ids), run_graph(lm.module, [ids])[0]) <= 1e-5


def test_run_cli_prints_tokens_and_the_dispatch_trace(tmp_path: Path) -> None:
    out = build(tmp_path, LLAMA, "w4-g32", "safetensors")
    r = run_cli("run", str(out), "--tokens", "5,17,99,3", "--max-new-tokens", "4", "--json")
    assert r.code == 0, r.err
    result = json.loads(r.out)
    assert len(result["generated"]) == 4
    assert result["kernels"] == {"prefill": ["cpu.int4pack"], "decode": ["cpu.int4pack"]}
    assert result["fallback_fraction"] == 0.0
    assert {d["selected"] for d in result["trace"]} == {"cpu.int4pack"}
    assert result["memory_bytes"]["repack_buffers"] > 0
    assert run_cli("run", str(out), "--tokens", "a,b").code == 1


BLOB = '"sha256:' + "0" * 64 + '", "mem"'
SEED_LEDGER = (
    "module @seed {\n"
    "  tensor @w.codes : i8[4096,4096] = blob<BLOB>\n"
    "  tensor @w.scale : f16[4096,32] = blob<BLOB>\n"
    "  ZERO_TENSOR\n"
    "  graph @g(%x: tensor<f32[1,4096]>) {\n"
    "    %w = q.weight() {codes = @w.codes, scale = @w.scale ZERO_BIND} : !q.affine<i4[-8:7] -> f32[4096,4096], "
    "group=(axis=1, size=128, tail=partial), qparams={scale: f16[4096,32] ZERO_SLOT}, decoder=1, req=linear>\n"
    "    %y = q.linear(%x, %w) : tensor<f32[1,4096]>\n"
    "    return(%y)\n"
    "  }\n"
    "}\n"
).replace("BLOB", BLOB)


@pytest.mark.parametrize(("zero", "mib"), [(False, 8.25), (True, 8.5)])
def test_rate_ledger_reproduces_the_seed_example(zero: bool, mib: float) -> None:
    """4096 x 4096 W4, groups of 128: 8.25 MiB with fp16 scales, 8.5 MiB with fp16 zero points too."""
    text = (
        SEED_LEDGER.replace("ZERO_TENSOR", f"tensor @w.zero : f16[4096,32] = blob<{BLOB}>" if zero else "")
        .replace("ZERO_BIND", ", zero = @w.zero" if zero else "")
        .replace("ZERO_SLOT", ", zero: f16[4096,32]" if zero else "")
    )
    ledger = rate_ledger(parse_module(text), {}, 4096 * 4096, 0)
    scopes = {s["scope"]: s for s in ledger["scopes"]}
    assert scopes["codes only"]["bits"] / 8 / 2**20 == 8.0
    assert scopes["codes + qparams"]["bits"] / 8 / 2**20 == mib
    assert scopes["codes + qparams"]["bits_per_weight"] == (4.125 if not zero else 4.25)
    assert scopes["codes + qparams + exceptions (sparse outliers)"]["bits"] == scopes["codes + qparams"]["bits"]


def test_verify_level_5_runs_the_runtime_rungs(tmp_path: Path) -> None:
    out = build(tmp_path, LLAMA, "w4-g32", "safetensors")
    r = run_cli("verify", str(out), "--level", "5", "--json")
    assert r.code == 0, r.out
    rungs = json.loads(r.out)["rungs"]
    r4, r5 = rungs["4_graph_logits"], rungs["5_dispatch_resources"]
    assert r4["layers"] == 14
    assert r4["max_layer_rel"] <= r4["bound"]
    assert r4["greedy_equal"]
    assert r4["strict_equal"]
    assert r4["near_ties"] == {"count": 0, "at": []}
    assert r4["greedy_tokens"] == 16
    assert r4["positions"] == 4 + 15  # the prompt and every generated token but the last
    assert r4["kernel_bound"] == 1e-5
    assert r4["bound"] == pytest.approx(1e-5 * math.sqrt(8))  # two layers of q, o, gate, down
    assert r4["compute"] == "f32"
    assert r5["kernels"] == ["cpu.int4pack"]
    assert r5["fallbacks"] == 0
    assert r5["memory"]["fallback_buffers"] == 0
    assert r5["failed"] == []
    kq = build(tmp_path, "qcompiler.examples:tiny_llama_wide_hf", "q4_k", "gguf")
    r = run_cli("verify", str(kq), "--level", "5", "--json")
    assert r.code == 1
    assert "fallback='forbid'" in json.loads(r.out)["error"]
    r = run_cli("verify", str(kq), "--level", "5", "--fallback", "warn", "--json")
    assert r.code == 0, r.out
    assert json.loads(r.out)["rungs"]["5_dispatch_resources"]["fallbacks"] == 28  # 14 ops x 2 phases


def test_inspect_load_shows_the_timeline_and_memory_ledger(tmp_path: Path) -> None:
    out = build(tmp_path, LLAMA, "w4-g32", "safetensors")
    r = run_cli("inspect", str(out), "--load", "--json")
    assert r.code == 0, r.err
    runtime = json.loads(r.out)["runtime"]
    assert set(runtime["timeline_s"]) == {
        "discover",
        "parse",
        "verify",
        "place",
        "read",
        "transfer",
        "repack",
        "warmup",
    }
    assert runtime["memory_bytes"]["repack_buffers"] > 0
    assert runtime["memory_bytes"]["resident_dense_tensors"] > 0
    assert runtime["kernels"] == {"cpu.int4pack (packed, prefill)": 14, "cpu.int4pack (packed, decode)": 14}
    assert runtime["loaded_bits_per_weight"] == 6.0  # int4 tiles + a float32 (scale, zero) pair per 32 weights
    assert run_cli("inspect", str(out), "--load").code == 0


def test_rung4_runs_the_reference_once_with_exact_and_bf16_compute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference interpreter runs once per rung 4 (teacher forcing on the runtime's 16 tokens). The
    exact kernels pass today's strict bound; bf16 compute passes the scaled bound, with every token the
    reference's argmax or an excused near tie."""
    out = build(tmp_path, LLAMA, "w4-g32", "safetensors")
    calls: list[int] = []
    reference = rungs.reference_values

    def counted(*args: Any) -> dict[str, torch.Tensor]:
        calls.append(int(args[2][0].shape[-1]))
        return reference(*args)

    monkeypatch.setattr(rungs, "reference_values", counted)
    exact = rungs.rung4(qcompiler.load(out))
    assert calls == [19]  # once, on the prompt and 15 generated tokens
    assert exact["failed"] == []
    assert exact["strict_equal"]
    assert exact["kernel_bound"] == 1e-5
    assert exact["max_layer_rel"] <= 1e-5  # the float32 kernels: within the kernel bound itself here
    narrow = rungs.rung4(qcompiler.load(out, compute="bf16"))
    assert calls == [19, 19]
    assert narrow["compute"] == "bf16"
    assert narrow["kernel_bound"] == 8e-3
    assert narrow["linear_depth"] == 9  # 2 layers of q, o, gate, down, and lm_head (bf16 compute)
    assert narrow["bound"] == pytest.approx(8e-3 * math.sqrt(9))
    assert narrow["failed"] == [], narrow["failed"]
    assert narrow["greedy_equal"]
    assert 1e-4 < narrow["max_layer_rel"] <= narrow["bound"]  # the narrowing shows, within the bound
    assert narrow["near_ties"]["count"] == len(narrow["near_ties"]["at"])


def test_run_and_verify_take_the_compute_and_report_it(tmp_path: Path) -> None:
    out = build(tmp_path, LLAMA, "w8-channel", "safetensors")
    r = run_cli("run", str(out), "--tokens", "5,17,99,3", "--max-new-tokens", "2", "--compute", "bf16", "--json")
    assert r.code == 0, r.err
    result = json.loads(r.out)
    assert result["compute"] == "bf16"
    assert result["kernels"] == {"prefill": ["cpu.int8pack-bf16"], "decode": ["cpu.int8pack-bf16"]}
    r = run_cli("run", str(out), "--tokens", "5,17,99,3", "--json")  # auto: the source model is float32
    assert json.loads(r.out)["compute"] == "f32"
    r = run_cli("verify", str(out), "--level", "4", "--compute", "bf16", "--json")
    assert r.code == 0, r.out
    result = json.loads(r.out)
    assert result["compute"] == "bf16"
    r4 = result["rungs"]["4_graph_logits"]
    assert r4["compute"] == "bf16"
    assert r4["kernel_bound"] == 8e-3
    assert r4["greedy_equal"]
    assert run_cli("verify", str(out), "--level", "4", "--compute", "f16").code != 0


def test_a_bf16_models_scales_are_widened_not_read_as_integers(tmp_path: Path) -> None:
    """compressed-tensors keeps a bf16 model's scales in bf16. The CPU kernels widen their bits; read as
    integers they made every output about 1e4 too large, which the load's self-check (decoding through the
    same parts) could not see, and rung 4 (against the reference interpreter) does."""
    out = build(tmp_path, "qcompiler.examples:tiny_llama_bf16_hf", "w4-g32", "safetensors")
    r = rungs.rung4(qcompiler.load(out))
    assert r["failed"] == [], r["failed"]
    assert r["kernel_bound"] == 8e-3  # the bf16 kernels, on the graph's own bf16 activations
    assert r["max_layer_rel"] <= r["bound"]
    assert r["greedy_equal"]

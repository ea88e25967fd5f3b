"""Gemma2 (``Gemma2ForCausalLM``) through every target: attention scores soft-capped (``attn_logit_softcapping``),
logits soft-capped (``final_logit_softcapping``), four ``1 + w`` RMS norms a layer, sliding-window
attention on the even layers, ``query_pre_attn_scalar``.

The frontend exports Gemma2's attention through ``qcompiler::softcapped_sdpa`` (``frontend/softcap.py``,
selected by ``frontend/hf_attention.py``), which lowers to ``sdpa {softcap}``. Tiny random models
saved by ``save_pretrained``, soft caps small enough to matter (5 and 3): each test also checks
that the model without them gives other logits. GGUF: llama.cpp's gemma2 graph runs the float
compile as transformers does and the ``q4_0`` compile as the model holding the artifact's decode.
safetensors (transformers' dequantizing load, ``verify --level 5``), onnx-nbits (onnxruntime, with and
without its KV cache) and triton (``verify``): the ``w4-g32`` artifact gives the logits of the model
holding its decode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from prequant_packers import IDS, artifact_decodes, llama_cpp_logits, logits, rel_l2
from torch import nn
from transformers.models.gemma2 import modeling_gemma2

import qcompiler
from qcompiler.backends.gguf.reader import open_gguf
from qcompiler.backends.onnx.feeds import prefill_feed, teacher_forced
from qcompiler.frontend.hf_attention import attention, softcapped_attention
from qcompiler.frontend.softcap import SOFTCAPPED, softcapped_sdpa
from qcompiler.ir.interpret import run_graph
from qcompiler.ir.printer import print_module
from qcompiler.testing import run_cli

CONFIG: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "max_position_embeddings": 128,
    "sliding_window": 6,
    "attn_logit_softcapping": 5.0,
    "final_logit_softcapping": 3.0,
    "initializer_range": 0.2,
}
"""Weights 10x transformers' default scale, so that both caps bite: without the attention cap this
model's logits are 0.17 rel-L2 away, without the final cap 0.31 (at 0.02 they were 1e-6 and 4e-3)."""
CAPS = ("attn_logit_softcapping", "final_logit_softcapping")


def gemma2(**over: Any) -> Any:
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**{**CONFIG, **over})).eval()


def saved(tmp_path: Path, **over: Any) -> tuple[Path, Any]:
    model = gemma2(**over)
    src = tmp_path / "gemma2"
    model.save_pretrained(src)
    return src, model


def uncapped(model: Any, want: np.ndarray) -> dict[str, float]:
    """rel-L2 from ``want`` of the logits of ``model``'s weights in a Gemma2 without one of its caps
    (each must be far above the tolerance of the comparison that uses ``want``)."""
    out: dict[str, float] = {}
    for cap in CAPS:
        plain: Any = type(model)(type(model.config)(**{**model.config.to_dict(), cap: None})).eval()
        plain.load_state_dict(model.state_dict())
        out[cap] = rel_l2(logits(plain), want)
    return out


def holding_decode(model: Any, artifact: Path) -> Any:
    decoded = artifact_decodes(artifact)
    assert decoded
    for name, values in decoded.items():
        model.get_parameter(name).data = torch.from_numpy(values.astype(np.float32))
    return model


def compile_ok(src: Path, target: str, out: Path, *extra: str) -> None:
    r = run_cli("compile", str(src), "--target", target, "-o", str(out), "--quiet", *extra)
    assert r.code == 0, (target, r.err)


# ------------------------------------------------------------------------------------ the attention op


def eager_masks(batch: int, seq: int, window: int) -> dict[str, torch.Tensor]:
    """transformers' eager masks (0 where a query attends, the float32 minimum elsewhere)."""
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    keeps = {"causal": j <= i, "sliding": (j <= i) & (i - j < window)}
    low = torch.finfo(torch.float32).min
    return {k: torch.where(keep, 0.0, low).expand(batch, 1, seq, seq) for k, keep in keeps.items()}


def test_the_op_computes_transformers_eager_gemma2_attention() -> None:
    """``softcapped_sdpa`` (through our transformers attention, which repeats the key/value heads) is
    transformers' eager Gemma2 attention bit for bit, on the causal and the sliding masks, with a
    boolean mask as with the additive one; a whole Gemma2 attending through it gives eager's logits
    exactly, and gets its own attention implementation back after."""
    model = gemma2()
    layer = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 16, generator=g) * 4 for h in (4, 2, 2))
    for name, mask in eager_masks(2, 24, 6).items():
        want, _ = modeling_gemma2.eager_attention_forward(layer, q, k, v, mask, scaling=0.25, softcap=5.0)
        got, _ = attention(layer, q, k, v, mask, scaling=0.25, softcap=5.0)
        assert torch.equal(got, want), name
        reps = [x.repeat_interleave(2, dim=1) for x in (k, v)]
        as_bool = softcapped_sdpa(q, *reps, mask == 0, 0.25, 5.0).transpose(1, 2)
        assert torch.equal(as_bool, want), name
        uncapped, _ = modeling_gemma2.eager_attention_forward(layer, q, k, v, mask, scaling=0.25)
        print(f"{name}: softcap 5 vs none, attention output rel-L2 {rel_l2(uncapped.numpy(), want.numpy()):.3f}")
        assert rel_l2(uncapped.numpy(), want.numpy()) > 1e-2
    before = model.config._attn_implementation
    want = logits(model)
    with softcapped_attention(model.config):
        assert model.config._attn_implementation == "qcompiler_softcap"
        assert np.array_equal(logits(model), want)
    assert model.config._attn_implementation == before


class Capped(nn.Module):
    """Soft-capped attention on a causal mask made from the inputs' length, then logits soft-capped."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = q.shape[2]
        keep = torch.arange(s)[None, :] <= torch.arange(s)[:, None]
        mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
        out = softcapped_sdpa(q, k, v, mask, 0.3, 2.0)
        return torch.tanh(out / 0.5) * 0.5


def test_the_op_and_the_soft_cap_lower_to_what_torch_computes() -> None:
    """The exported program holds the op as one node; it lowers to one ``sdpa {causal, scale,
    softcap}`` (its mask recognised at every length, then dropped), and the logit cap to ``div``,
    ``tanh``, ``mul``; the reference interpreter gives torch's output at three sequence lengths."""
    qkv = tuple(torch.randn(1, 4, 7, 8) for _ in range(3))
    dyn = {name: {2: "seq"} for name in ("q", "k", "v")}
    dims = {name: {2: torch.export.Dim("seq", min=2, max=64)} for name in ("q", "k", "v")}
    ep = torch.export.export(Capped(), qkv, dynamic_shapes=dims)
    assert [n.target for n in ep.graph.nodes].count(SOFTCAPPED) == 1
    m = qcompiler.capture(Capped(), qkv, dynamic=dyn)
    ops = [o.name for o in m.graphs[0].ops]
    assert ops.count("sdpa") == 1
    assert {"div", "tanh", "mul"} <= set(ops), ops
    assert "{causal = true, scale = 0.3, softcap = 2.0}" in print_module(m), print_module(m)
    for seq in (2, 7, 19):
        q, k, v = (torch.randn(1, 4, seq, 8) * 3 for _ in range(3))
        got, want = run_graph(m, [q, k, v])[0], Capped()(q, k, v)
        diff = float((got - want).abs().max())
        print(f"seq {seq}: interpreter vs torch max |diff| {diff:.2e}")
        assert torch.allclose(got, want, rtol=0, atol=1e-6), diff


# ----------------------------------------------------------------------------------------------- gguf


Q8_ACTIVATIONS = 3e-2
"""llama.cpp's Q4_0 matmuls round activations to Q8_0 (as for Gemma3: four norms a layer)."""


def test_llama_cpp_runs_gemma2(tmp_path: Path) -> None:
    """The F32 compile is llama.cpp's gemma2 (both caps and the window in its metadata) and gives
    transformers' logits at 24 tokens, 4x the window; without the caps they would be far off. The
    ``q4_0`` compile gives the logits of the model holding its decode (1.8e-2 rel-L2: llama.cpp rounds
    activations to Q8_0; the F32 compile is 5.2e-4 from transformers), and ``verify`` passes. A
    gemma2 ``.gguf`` is not importable as a SOURCE yet: refused by name."""
    src, model = saved(tmp_path)
    out = tmp_path / "f32"
    compile_ok(src, "gguf", out)
    meta = open_gguf(out / "model.gguf").metadata
    assert meta["general.architecture"][1] == "gemma2"
    caps = ("attn_logit_softcapping", "final_logit_softcapping", "attention.sliding_window")
    assert [meta[f"gemma2.{k}"][1] for k in caps] == [5.0, 3.0, 6]
    want = logits(model)
    f32, without = rel_l2(llama_cpp_logits(out), want), uncapped(model, want)
    print(f"gguf F32: llama.cpp vs transformers rel-L2 {f32:.2e}; the model without each cap {without}")
    assert f32 < 2e-3
    assert min(without.values()) > 5e-2
    q4 = tmp_path / "q4_0"
    compile_ok(src, "gguf", q4, "--scheme", "q4_0")
    got = rel_l2(llama_cpp_logits(q4), logits(holding_decode(model, q4)))
    print(f"gguf Q4_0: llama.cpp vs the model holding the artifact's decode rel-L2 {got:.2e}")
    assert got < Q8_ACTIVATIONS
    assert run_cli("verify", str(q4), "--level", "5").code == 0
    r = run_cli("compile", str(q4 / "model.gguf"), "--target", "gguf", "-o", str(tmp_path / "again"), "--quiet")
    assert r.code == 1
    assert "architecture not importable" in r.err, r.err
    assert "found gemma2" in r.err, r.err
    assert "Traceback" not in r.err


REFUSED: dict[str, dict[str, Any]] = {
    "layer_types": {"layer_types": ["full_attention", "sliding_attention"] * 2},
    "attn_logit_softcapping": {"attn_logit_softcapping": None},
    "final_logit_softcapping": {"final_logit_softcapping": None},
    "query_pre_attn_scalar": {"query_pre_attn_scalar": 32},
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_gguf_refuses_what_llama_cpp_gemma2_fixes(field: str, tmp_path: Path) -> None:
    """llama.cpp's gemma2 graph fixes the sliding pattern (even layers), always caps scores and
    logits, and scales queries by ``head_dim ** -0.5``: a config that says otherwise is refused from
    config.json before the capture, naming the field, and leaves nothing; safetensors takes it."""
    src, _ = saved(tmp_path, **REFUSED[field])
    out = tmp_path / "gguf"
    r = run_cli("compile", str(src), "--target", "gguf", "-o", str(out), "--quiet")
    assert r.code == 1, r.err
    assert "Traceback" not in r.err
    assert f"llama.cpp's gemma2 graph fixes config.json's {field}" in r.err, r.err
    assert not out.exists()
    compile_ok(src, "safetensors", tmp_path / "st")


# ------------------------------------------------------------------------------- the graph targets


def test_gemma2_through_safetensors_onnx_and_triton(tmp_path: Path) -> None:
    """``w4-g32``: every graph says ``softcap = 5.0`` and ``window = 6``; transformers' dequantizing load
    (no missing or unexpected key), onnxruntime's no-cache graph and its KV-cache graph decoding one
    token at a time give the logits of the model holding the artifact's decode; ``verify`` passes
    (``--level 5`` for safetensors: the CPU runtime too)."""
    import onnxruntime as ort

    src, model = saved(tmp_path)
    outs = {t: tmp_path / t for t in ("safetensors", "onnx-nbits", "triton")}
    for target, out in outs.items():
        compile_ok(src, target, out, "--scheme", "w4-g32")
        text = (out / "graph.qir").read_text()
        assert text.count("softcap = 5.0") == 4, target
        assert text.count("window = 6") == 2, target
        assert run_cli("verify", str(out), "--level", "5").code == 0, target
    want = logits(holding_decode(model, outs["safetensors"]))
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
        outs["safetensors"],
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
        dtype=torch.float32,
        output_loading_info=True,
    )
    back, info = loaded
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    numbers = {"safetensors": rel_l2(logits(back.eval()), want), **uncapped(model, want)}
    opts = ["CPUExecutionProvider"]
    ids = np.array([IDS], dtype=np.int64)
    sess = ort.InferenceSession(str(outs["onnx-nbits"] / "model.onnx"), providers=opts)
    numbers["onnx"] = rel_l2(np.asarray(sess.run(None, prefill_feed(sess, ids))[0])[0].astype(np.float64), want)
    numbers["onnx kv-cache"] = rel_l2(teacher_forced(sess, ids, 10)[0].astype(np.float64), want)
    print("w4-g32 vs the model holding the decode, rel-L2:", {k: f"{v:.2e}" for k, v in numbers.items()})
    assert numbers["safetensors"] < 1e-5
    assert numbers["onnx"] < 1e-3
    assert numbers["onnx kv-cache"] < 1e-3
    assert min(numbers[cap] for cap in CAPS) > 5e-2

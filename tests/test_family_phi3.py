"""Phi-3 / Phi-4 (``Phi3ForCausalLM``) through every target. Phi-3 fuses q, k and v into one
``qkv_proj`` and gate and up into one ``gate_up_proj``; its forward slices the first (``aten.slice``)
and chunks the second (``aten.chunk``, or ``aten.split`` after decomposition), whose parts
``operator.getitem`` picks: QIR ``slice`` ops.

Two tiny random models saved by ``save_pretrained``: a Phi-3 (untied head, whole-head RoPE) and one
shaped like Phi-4-mini where it matters here (``partial_rotary_factor`` 0.75, tied head, rope_theta
250000; its long-context ``longrope`` is refused, below). Phi-4 itself is a Phi-3 of other sizes.
GGUF: the float compile run by llama.cpp gives transformers' logits; a ``q4_0`` compile run by
llama.cpp gives the logits of the model holding the artifact's own decode; ``verify`` passes; the
``.gguf`` read back as a SOURCE re-emits the same file byte for byte; ``q4_k_m``/``q5_k_m`` pick
``llama_model_quantize``'s type for every tensor and its bytes. safetensors (transformers'
dequantizing load), onnx-nbits (onnxruntime) and triton (``verify``): a ``w4-g32`` compile gives the
logits of the model with the artifact's own decode, and the fused weights decode as their parts
quantized alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from prequant_packers import IDS, artifact_decodes, assert_equals_llama_quantize, llama_cpp_logits, logits, rel_l2
from torch import nn

import qcompiler
from qcompiler.backends.gguf.reader import open_gguf
from qcompiler.backends.onnx.feeds import prefill_feed
from qcompiler.frontend.context import UnsupportedError
from qcompiler.ir.interpret import run_graph
from qcompiler.quant.rtn import quantize_weight
from qcompiler.quant.schemes import parse_scheme
from qcompiler.testing import run_cli

COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "eos_token_id": 2,
}
PHI4_MINI_ROPE = {"rope_type": "default", "rope_theta": 250000.0, "partial_rotary_factor": 0.75}
CONFIGS: dict[str, dict[str, Any]] = {
    "phi3": {},
    "phi4-mini-shape": {"tie_word_embeddings": True, "rope_parameters": PHI4_MINI_ROPE},
}


def phi3(name: str, **over: Any) -> Any:
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(**{**COMMON, **CONFIGS[name], **over})).eval()


def compile_ok(*args: str) -> None:
    r = run_cli("compile", *args, "--quiet")
    assert r.code == 0, r.err


def holding_decode(model: nn.Module, artifact: Path) -> nn.Module:
    decoded = artifact_decodes(artifact)
    assert decoded
    for name, values in decoded.items():
        model.get_parameter(name).data = torch.from_numpy(values.astype(np.float32))
    return model


# ------------------------------------------------------------------------------------- the split lowerings


class Parts(nn.Module):
    """Every part of ``cut(x)``, each scaled, so each ``getitem`` is a node of its own."""

    def __init__(self, cut: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]) -> None:
        super().__init__()
        self.cut = cut

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(p * (i + 1) for i, p in enumerate(self.cut(x)))


def split3(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x.split(3, dim=-1)  # 3, 3, 2: a short last part


def split_sizes(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x.split([2, 5, 1], dim=2)


def halves(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x.chunk(2, dim=-1)  # Phi-3's gate_up


def thirds(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x.chunk(3, dim=0)


def split_seq(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x.split(4, dim=1)


def split_last(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x.split(4, dim=-1)


SPLITS: dict[str, tuple[Any, Callable[[torch.Tensor], tuple[torch.Tensor, ...]]]] = {
    "split": (torch.ops.aten.split.Tensor, split3),
    "split_with_sizes": (torch.ops.aten.split_with_sizes.default, split_sizes),
    "chunk": (torch.ops.aten.chunk.default, halves),
    "chunk_uneven": (torch.ops.aten.chunk.default, thirds),
}


@pytest.mark.parametrize("kind", sorted(SPLITS))
def test_each_split_lowering_reproduces_torch(kind: str) -> None:
    """Each overload is in the exported graph as named, and the QIR (one ``slice`` per part, the
    sequence dim dynamic) reproduces torch exactly at three sequence lengths."""
    op, cut = SPLITS[kind]
    model = Parts(cut)
    x = torch.randn(3, 5, 8)
    ep = torch.export.export(model, (x,), dynamic_shapes=({1: torch.export.Dim("seq", min=2, max=64)},))
    assert op in {n.target for n in ep.graph.nodes}
    m = qcompiler.capture(model, (x,), dynamic={"x": {1: "seq"}})
    ops = [o.name for o in m.graphs[0].ops]
    assert ops.count("slice") == len(model(x)), ops
    for seq in (2, 5, 13):
        x = torch.randn(3, seq, 8)
        got, want = run_graph(m, [x]), model(x)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), kind


def test_a_split_along_a_dynamic_axis_is_refused() -> None:
    """torch.export itself refuses to split ``?seq`` (its guards fail): a typed error. A program that
    splits along it anyway (here: the exported split's axis edited to the dynamic one) is refused by
    the lowering, naming the op and the dynamic dim."""
    x = torch.randn(1, 8, 8)
    with pytest.raises(UnsupportedError, match=r"torch\.export cannot capture"):
        qcompiler.capture(Parts(split_seq), (x,), dynamic={"x": {1: "seq"}})
    model = Parts(split_last)
    ep = torch.export.export(model, (x,), dynamic_shapes=({1: torch.export.Dim("seq", min=2, max=64)},))
    split = next(n for n in ep.graph.nodes if n.target == torch.ops.aten.split.Tensor)
    split.args = (split.args[0], 4, 1)
    with pytest.raises(UnsupportedError, match=r"split.Tensor \(split\) along dim 1 of dynamic size \?seq"):
        qcompiler.capture(model, (x,), dynamic={"x": {1: "seq"}}, exported=ep)


# ----------------------------------------------------------------------------------------------- gguf


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_llama_cpp_runs_phi3(name: str, tmp_path: Path) -> None:
    model = phi3(name)
    src = tmp_path / name
    model.save_pretrained(src)
    out = tmp_path / "f32"
    compile_ok(str(src), "--target", "gguf", "-o", str(out))
    f = open_gguf(out / "model.gguf")
    assert f.metadata["general.architecture"][1] == "phi3"
    assert f.tensors["blk.0.attn_qkv.weight"].shape == (64 + 2 * 32, 64)  # q, then k, then v rows (ours: N, K)
    assert f.tensors["blk.0.ffn_up.weight"].shape == (2 * 128, 64)  # gate, then up
    assert ("output.weight" in f.tensors) is (name == "phi3")
    assert f.metadata["phi3.rope.dimension_count"][1] == (16 if name == "phi3" else 12)
    rel = rel_l2(llama_cpp_logits(out), logits(model))
    print(f"{name} F32: llama.cpp vs transformers rel-L2 {rel:.2e}")
    assert rel <= 1e-2
    q4 = tmp_path / "q4_0"
    compile_ok(str(src), "--scheme", "q4_0", "--target", "gguf", "-o", str(q4))
    rel = rel_l2(llama_cpp_logits(q4), logits(holding_decode(model, q4)))
    print(f"{name} Q4_0: llama.cpp vs the artifact's decode rel-L2 {rel:.2e}")
    assert rel <= 1e-2
    for art in (out, q4):
        assert run_cli("verify", str(art), "--level", "5").code == 0
        again = tmp_path / f"again-{art.name}"
        compile_ok(str(art / "model.gguf"), "--target", "gguf", "-o", str(again))
        assert (again / "model.gguf").read_bytes() == (art / "model.gguf").read_bytes()


@pytest.mark.parametrize(("scheme", "ftype"), [("q4_k_m", "MOSTLY_Q4_K_M"), ("q5_k_m", "MOSTLY_Q5_K_M")])
def test_mixtures_equal_llama_model_quantize(tmp_path: Path, scheme: str, ftype: str) -> None:
    """Hidden and FFN width 256 (whole K-quant super-blocks): ``--scheme q4_k_m`` gives every tensor,
    the fused ``attn_qkv`` included (as ``attn_v``: Q6_K in the "more bits" layer 1, the base type in
    layer 0), the type ``llama_model_quantize`` gives it from our F32 file, and the same bytes."""
    src, ours, f32 = tmp_path / "src", tmp_path / "ours", tmp_path / "f32"
    phi3("phi3", hidden_size=256, intermediate_size=256).save_pretrained(src)
    compile_ok(str(src), "--scheme", scheme, "--target", "gguf", "-o", str(ours))
    compile_ok(str(src), "--target", "gguf", "-o", str(f32))
    b = assert_equals_llama_quantize(ours, f32, f"LLAMA_FTYPE_{ftype}", tmp_path)
    base = "Q4_K" if scheme == "q4_k_m" else "Q5_K"
    assert [b[f"blk.{i}.attn_qkv.weight"].tensor_type.name for i in (0, 1)] == [base, "Q6_K"]
    assert run_cli("verify", str(ours)).code == 0


def test_gguf_refuses_what_llama_cpp_needs_and_it_does_not_write(tmp_path: Path) -> None:
    """Phi-3-128k / Phi-4-mini's ``longrope`` needs llama.cpp's rope_factors_long/short tensors, and a
    ``head_dim`` other than hidden / heads breaks llama.cpp's qkv slicing: both refused from config.json
    before the capture, naming the field, with no traceback and no output; safetensors takes them."""
    factors = [1.0] * 8  # one per rotated pair: head 16 / 2
    longrope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "long_factor": factors,
        "short_factor": factors,
        "original_max_position_embeddings": 64,
    }
    cases = {
        "longrope": ({"rope_parameters": longrope}, ["config.json rope_parameters", "'longrope'", "rope_factors_long"]),
        "head_dim": ({"head_dim": 32}, ["config.json head_dim 32", "hidden_size / num_attention_heads (64 / 4)"]),
    }
    for case, (over, words) in cases.items():
        src = tmp_path / case
        phi3("phi3", **over).save_pretrained(src)
        out = tmp_path / f"{case}-gguf"
        r = run_cli("compile", str(src), "--target", "gguf", "-o", str(out), "--quiet")
        assert r.code == 1, r.err
        assert "Traceback" not in r.err
        for word in words:
            assert word in r.err, r.err
        assert not out.exists()
    compile_ok(str(tmp_path / "head_dim"), "--target", "safetensors", "-o", str(tmp_path / "head_dim-st"))


# --------------------------------------------------------------------------- safetensors, onnx-nbits, triton


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_phi3_through_safetensors_onnx_and_triton(name: str, tmp_path: Path) -> None:
    import onnxruntime as ort

    model = phi3(name)
    src = tmp_path / name
    model.save_pretrained(src)
    outs = {t: tmp_path / t for t in ("safetensors", "onnx-nbits", "triton")}
    for target, out in outs.items():
        compile_ok(str(src), "--scheme", "w4-g32", "--target", target, "-o", str(out))
        assert run_cli("verify", str(out), "--level", "5").code == 0, target
    floats = {k: v.detach().clone() for k, v in model.state_dict().items()}
    want = logits(holding_decode(model, outs["safetensors"]))
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
        outs["safetensors"],
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
        dtype=torch.float32,
        output_loading_info=True,
    )
    back, info = loaded
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    rel = rel_l2(logits(back.eval()), want)
    print(f"{name} safetensors w4-g32: transformers' dequantizing load vs the artifact's decode rel-L2 {rel:.2e}")
    assert rel <= 1e-5
    sess = ort.InferenceSession(str(outs["onnx-nbits"] / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = prefill_feed(sess, np.array([IDS], dtype=np.int64))
    rel = rel_l2(np.asarray(sess.run(None, feeds)[0])[0].astype(np.float64), want)
    print(f"{name} onnx-nbits w4-g32: onnxruntime vs the artifact's decode rel-L2 {rel:.2e}")
    assert rel <= 1e-3
    check_fused_parts(outs["safetensors"], floats)


def check_fused_parts(artifact: Path, floats: dict[str, torch.Tensor]) -> None:
    """Groups run along K, so no group mixes rows of q, k and v (or of gate and up): the fused weight's
    decode is, bit for bit, each part's own ``w4-g32`` quantization decoded, rows side by side."""
    decoded = artifact_decodes(artifact)
    scheme = parse_scheme("w4-g32")
    fused = {"self_attn.qkv_proj": (64, 32, 32), "mlp.gate_up_proj": (128, 128)}
    for module, sizes in fused.items():
        name = f"model.layers.0.{module}.weight"
        w, start = floats[name], 0
        for size in sizes:
            alone = quantize_weight(w[start : start + size], scheme).dequantize().numpy()
            assert np.array_equal(decoded[name][start : start + size].view(np.uint32), alone.view(np.uint32)), name
            start += size

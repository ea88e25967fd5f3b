"""GPT-2 (``GPT2LMHeadModel``: ``Conv1D`` projections, fused ``c_attn``, learned positions, tied head)
through every target, and the lowerings it brought.

Tiny random models saved by ``save_pretrained``. GGUF: the float compile run by llama.cpp gives
transformers' logits; a ``q4_0`` compile run by llama.cpp gives the logits of the model whose
``Conv1D`` weights are the artifact's own decode (transposed back: the decode is ``[N, K]``, a
``Conv1D`` holds ``[K, N]``); ``q4_k_m``/``q5_k_m`` equal byte for byte what ``llama_model_quantize``
writes from our F32 file. onnx-nbits (onnxruntime) and triton (``verify``) with ``w4-g32``;
safetensors float (transformers' load), and its refusal of a quantized ``Conv1D``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from prequant_packers import artifact_decodes, assert_equals_llama_quantize, llama_cpp_logits, rel_l2
from torch import nn
from transformers.pytorch_utils import Conv1D

import qcompiler
from qcompiler.backends.gguf.schemes import GGML
from qcompiler.backends.onnx.feeds import prefill_feed
from qcompiler.frontend.hf import wrap_hf
from qcompiler.ir.interpret import run_graph
from qcompiler.quant.modules import QuantLinear
from qcompiler.testing import run_cli

IDS = [1, 5, 9, 33, 2, 7, 100, 4]


def gpt2(**extra: Any) -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128, **extra)
    return transformers.GPT2LMHeadModel(cfg).eval()


def logits(model: Any) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([IDS])).logits[0].double().numpy()


def with_decodes(model: Any, out: Path) -> Any:
    """``model`` holding the artifact's own decode of each quantized weight: a ``Conv1D``'s ``[N, K]``
    decode transposed to the ``[K, N]`` it stores (even when square: c_proj is [64, 64])."""
    decoded = artifact_decodes(out)
    assert decoded
    for name, values in decoded.items():
        w = torch.from_numpy(values.astype(np.float32))
        owner = model.get_submodule(name.rpartition(".")[0])
        model.get_parameter(name).data = (w.t() if isinstance(owner, Conv1D) else w).contiguous()
    return model


class Projection(nn.Module):
    """A ``Conv1D`` (``addmm`` on rows flattened by ``view``) then GPT-2's ``split`` of its output."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = Conv1D(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).split(4, dim=-1)
        return q * 2 + k - v


@pytest.mark.parametrize("scheme", [None, "w4-g32"])
def test_addmm_and_split_lower_as_torch_computes_them(scheme: str | None) -> None:
    """``aten.addmm`` (``Conv1D``: ``x @ W + b``, W ``[K, N]``) lowers to ``linear(x, transpose(W), b)``
    with its ``view(x, [-1, K])`` looked through; ``split`` + ``getitem`` lower to slices. Float and
    quantized (the Conv1D quantized as the Linear it computes), the graph reproduces torch."""
    torch.manual_seed(0)
    model = Projection().eval()
    if scheme:
        qcompiler.quantize(model, scheme)
        assert isinstance(model.proj, QuantLinear)
    x = torch.randn(2, 5, 8)
    m = qcompiler.capture(model, (x,), dynamic={"x": {0: "batch", 1: "seq"}})
    ops = [op.name for op in m.graphs[0].ops]
    assert "linear" in ops
    assert ops.count("slice") == 3
    assert ("transpose" in ops) == (scheme is None)  # the float weight is kept [K, N], as stored
    for shape in ((2, 5, 8), (1, 3, 8), (3, 9, 8)):
        x = torch.randn(*shape)
        with torch.no_grad():
            want = model(x)
        (got,) = run_graph(m, [x])
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), shape


def test_conv1d_gets_the_codes_of_its_linear() -> None:
    """A quantized Conv1D holds exactly the codes and scales of the nn.Linear with weight ``W.T``, and
    its source says the checkpoint held it ``[K, N]``."""
    torch.manual_seed(0)
    conv = Conv1D(96, 64)
    nn.init.normal_(conv.weight)
    linear = nn.Linear(64, 96)
    linear.weight.data = conv.weight.data.t().contiguous()
    linear.bias.data = conv.bias.data.clone()
    a, b = nn.Sequential(conv), nn.Sequential(linear)
    qcompiler.quantize(a, "w4-g32")
    qcompiler.quantize(b, "w4-g32")
    qa, qb = a[0], b[0]
    assert isinstance(qa, QuantLinear)
    assert isinstance(qb, QuantLinear)
    for name in ("codes", "scale"):
        assert torch.equal(getattr(qa, name), getattr(qb, name)), name
    assert qa.codes.shape == (96, 64)
    assert qa.source["orientation"] == "from Conv1D [K, N]"
    assert "orientation" not in qb.source


def test_llama_cpp_runs_gpt2(tmp_path: Path) -> None:
    """F32 and Q4_0 GGUFs of a GPT-2 run by llama.cpp (architecture ``gpt2``): the float one gives
    transformers' logits (measured rel-L2 1.8e-4), the Q4_0 one those of the model holding the
    artifact's decode (5e-3: llama.cpp quantizes activations to Q8 for Q4_0 products); c_attn stays
    one fused ``attn_qkv`` of ggml shape ``[K, 3K]``; ``verify`` passes. The provenance records that
    the weights came from ``Conv1D [K, N]``. Reading such a file back as a source is refused by name."""
    model = gpt2()
    src = tmp_path / "gpt2"
    model.save_pretrained(src)
    f32 = tmp_path / "f32"
    r = run_cli("compile", str(src), "--target", "gguf", "-o", str(f32), "--quiet")
    assert r.code == 0, r.err
    tensors = {t.name: t for t in gguf.GGUFReader(str(f32 / "model.gguf")).tensors}
    assert [int(d) for d in tensors["blk.0.attn_qkv.weight"].shape] == [64, 192]
    assert "output.weight" not in tensors
    assert "position_embd.weight" in tensors
    assert rel_l2(llama_cpp_logits(f32, IDS), logits(model)) < 1e-3
    assert run_cli("verify", str(f32)).code == 0
    q4 = tmp_path / "q4_0"
    r = run_cli("compile", str(src), "--scheme", "q4_0", "--target", "gguf", "-o", str(q4), "--quiet")
    assert r.code == 0, r.err
    assert rel_l2(llama_cpp_logits(q4, IDS), logits(with_decodes(model, q4))) < 1e-2
    assert run_cli("verify", str(q4), "--level", "5").code == 0
    assert "from Conv1D [K, N]" in (q4 / "graph.qir").read_text()
    r = run_cli("compile", str(q4 / "model.gguf"), "--target", "gguf", "-o", str(tmp_path / "again"), "--quiet")
    assert r.code == 1
    assert "Traceback" not in r.err
    assert "architecture not importable" in r.err
    assert "found gpt2" in r.err


@pytest.mark.parametrize(
    ("scheme", "ftype"), [("q4_k_m", "LLAMA_FTYPE_MOSTLY_Q4_K_M"), ("q5_k_m", "LLAMA_FTYPE_MOSTLY_Q5_K_M")]
)
def test_gpt2_mixture_equals_llama_model_quantize(tmp_path: Path, scheme: str, ftype: str) -> None:
    """``--scheme q4_k_m``/``q5_k_m`` on GPT-2 makes llama.cpp's per-tensor choices, byte for byte:
    ``attn_qkv`` counted as ``attn_v`` (Q8_0 in the "more bits" layer), ``ffn_down`` (K = 256) a
    K-quant, the tied token table the output's type, ``position_embd`` left F32."""
    src = tmp_path / "gpt2"
    gpt2().save_pretrained(src)
    ours, f32 = tmp_path / "ours", tmp_path / "f32"
    assert run_cli("compile", str(src), "--scheme", scheme, "--target", "gguf", "-o", str(ours)).code == 0
    assert run_cli("compile", str(src), "--target", "gguf", "-o", str(f32)).code == 0
    b = assert_equals_llama_quantize(ours, f32, ftype, tmp_path)
    assert b["position_embd.weight"].tensor_type.name == "F32"  # ours equal it, type for type
    assert b["blk.1.attn_qkv.weight"].tensor_type.name == "Q8_0"
    assert run_cli("verify", str(ours)).code == 0


def test_mixtures_quantize_only_the_token_embedding() -> None:
    """A mixture plans the token table, never another embedding: GPT-2's ``wpe`` and OPT's learned
    positions (a module taking ``position_ids``, which a quantized replacement would not) stay."""
    opt_cfg = transformers.OPTConfig(
        vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, word_embed_proj_dim=64,
    )  # fmt: skip
    cases = {
        "transformer.w": gpt2(tie_word_embeddings=False),
        "model.decoder.embed_": transformers.OPTForCausalLM(opt_cfg),
    }
    for prefix, model in cases.items():
        cap = wrap_hf(model.eval())
        plan = GGML.plan(cap.module, "q4_k_m", ("lm_head",), False, None)
        embeddings = sorted(fqn.removeprefix("hf.") for fqn in plan if fqn.removeprefix("hf.").startswith(prefix))
        assert embeddings == [prefix + ("te" if prefix.endswith("w") else "tokens")], embeddings


def test_gpt2_through_onnx_triton_and_safetensors(tmp_path: Path) -> None:
    """``w4-g32`` to onnx-nbits (onnxruntime gives the logits of the model holding the artifact's
    decode) and triton (``verify``); safetensors float (transformers loads it: the same logits), and
    quantized refused before the capture, saying why (compressed-tensors groups along the stored
    ``[K, N]`` weight's last dim) and what works instead."""
    import onnxruntime as ort

    model = gpt2()
    src = tmp_path / "gpt2"
    model.save_pretrained(src)
    want_float = logits(model)
    st = tmp_path / "st"
    assert run_cli("compile", str(src), "--target", "safetensors", "-o", str(st), "--quiet").code == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(st, dtype=torch.float32).eval()
    assert rel_l2(logits(back), want_float) < 1e-6
    refused = tmp_path / "st-q"
    r = run_cli("compile", str(src), "--scheme", "w4-g32", "--target", "safetensors", "-o", str(refused), "--quiet")
    assert r.code == 1
    assert "Traceback" not in r.err
    assert not refused.exists()
    for word in ("Conv1D", "[K, N]", "compressed-tensors", "without --scheme", "onnx-nbits"):
        assert word in r.err, r.err
    outs = {t: tmp_path / t for t in ("onnx-nbits", "triton")}
    for target, out in outs.items():
        r = run_cli("compile", str(src), "--scheme", "w4-g32", "--target", target, "-o", str(out), "--quiet")
        assert r.code == 0, (target, r.err)
        assert run_cli("verify", str(out), "--level", "5").code == 0, target
    want = logits(with_decodes(model, outs["onnx-nbits"]))
    sess = ort.InferenceSession(str(outs["onnx-nbits"] / "model.onnx"), providers=["CPUExecutionProvider"])
    got = np.asarray(sess.run(None, prefill_feed(sess, np.array([IDS], dtype=np.int64)))[0])[0].astype(np.float64)
    assert rel_l2(got, want) < 1e-3


def test_gpt2_names_agree_with_gguf_py() -> None:
    """Every GPT-2 checkpoint tensor's GGUF name is the one gguf-py's name map gives it."""
    from qcompiler.backends.gguf.archs import ARCHS

    theirs = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, 2)
    names = [f"transformer.{n}.{s}" for n in ("ln_f",) for s in ("weight", "bias")]
    names += ["transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"]
    layer = ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
    names += [f"transformer.h.{i}.{n}.{s}" for i in (0, 1) for n in layer for s in ("weight", "bias")]
    for hf in names:
        assert ARCHS["gpt2"].gguf_name(hf) == theirs.get_name(hf, try_suffixes=(".weight", ".bias")), hf

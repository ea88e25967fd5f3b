"""Mixture-of-experts models (Mixtral) through every target.

A tiny random Mixtral (hidden 64, ff 128, 4 experts, top-2, 2 layers, vocab 256) saved by
``save_pretrained``, which writes the hub's per-expert form (``block_sparse_moe.experts.N.w1/w2/w3``).
The frontend replaces transformers' data-dependent expert loop with a static, exact graph
(``quant/experts.py``: every expert on every token, weighted by the router's dense top-k matrix).
Checked: ``topk_mask`` lowered alone against torch; the dense formulation against transformers' eager
MoE; llama.cpp (``llama`` with stacked ``ffn_*_exps``) against transformers (F32) and against the
artifact's own decode (Q4_0); onnxruntime and transformers' dequantizing load against the decode
(w4-g32); triton ``verify``; every expert's quantized weight decodes to what quantizing it alone gives;
``q4_k_m`` equal to ``llama_model_quantize`` byte for byte. ``-s`` prints the measured numbers.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from prequant_packers import artifact_decodes, assert_equals_llama_quantize, llama_cpp_logits, rel_l2

import qcompiler
from qcompiler.backends.gguf.reader import open_gguf
from qcompiler.backends.onnx.feeds import prefill_feed
from qcompiler.ir.interpret import run_graph
from qcompiler.quant.experts import unfuse_experts
from qcompiler.testing import run_cli

IDS = [1, 5, 9, 33, 2, 7, 100, 4]


def mixtral(hidden: int = 64, ff: int = 128, experts: int = 4) -> Any:
    cfg = transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=ff,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_local_experts=experts,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).eval()


def logits(model: Any, ids: list[int] = IDS) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].double().numpy()


def with_decode(model: Any, artifact: Path) -> Any:
    """``model`` (its experts unfused) holding the artifact's own decode of every quantized weight."""
    model = unfuse_experts(copy.deepcopy(model))
    decoded = artifact_decodes(artifact)
    assert decoded
    for name, values in decoded.items():
        model.get_parameter(name).data = torch.from_numpy(values.astype(np.float32))
    return model


def test_topk_mask_lowers_as_torch_computes_it() -> None:
    """A router's softmax, dense top-k and renormalisation, captured and run by the QIR interpreter."""

    class Route(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = torch.ops.qcompiler.topk_mask(torch.softmax(x, dim=-1), 3)
            return w / w.sum(dim=-1, keepdim=True)

    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    m = qcompiler.capture(Route(), (x,), dynamic={"x": {1: "seq"}})
    assert "topk_mask" in [op.name for op in m.ops()]
    for seq in (5, 9):
        x = torch.randn(2, seq, 8, generator=torch.Generator().manual_seed(seq))
        (got,) = run_graph(m, [x])
        assert torch.equal(got, Route()(x))
        values, index = torch.topk(torch.softmax(x, -1), 3, dim=-1)  # the router as transformers writes it
        want = torch.zeros(2, seq, 8).scatter(-1, index, values / values.sum(-1, keepdim=True))
        assert torch.allclose(got, want, rtol=1e-6, atol=0)  # the same up to the sum's order
        assert int((got != 0).sum()) == 2 * seq * 3


def test_dense_experts_equal_transformers_eager_moe() -> None:
    model = mixtral()
    model.set_experts_implementation("eager")
    want = logits(model)
    dense = unfuse_experts(copy.deepcopy(model))
    names = [n for n, _ in dense.named_parameters() if "layers.0.block_sparse_moe" in n]
    assert names[:2] == [
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.0.block_sparse_moe.experts.0.w1.weight",
    ]
    assert not any(".mlp." in n for n, _ in dense.named_parameters())
    err = rel_l2(logits(dense), want)
    print(f"\ndense experts vs transformers' eager MoE: rel-L2 {err:.2e}")
    assert err < 1e-5


def test_llama_cpp_runs_mixtral(tmp_path: Path) -> None:
    model = mixtral()
    src = tmp_path / "mixtral"
    model.save_pretrained(src)
    out = tmp_path / "f32"
    r = run_cli("compile", str(src), "--target", "gguf", "-o", str(out), "--quiet")
    assert r.code == 0, r.err
    f = open_gguf(out / "model.gguf")
    assert f.metadata["general.architecture"][1] == "llama"
    assert (f.metadata["llama.expert_count"][1], f.metadata["llama.expert_used_count"][1]) == (4, 2)
    assert f.tensors["blk.0.ffn_gate_exps.weight"].shape == (4, 128, 64)
    assert f.tensors["blk.1.ffn_down_exps.weight"].shape == (4, 64, 128)
    assert f.tensors["blk.0.ffn_gate_inp.weight"].shape == (4, 64)
    assert "blk.0.ffn_gate.weight" not in f.tensors
    err = rel_l2(llama_cpp_logits(out, IDS), logits(model))
    print(f"\nllama.cpp F32 vs transformers: rel-L2 {err:.2e}")
    assert err < 2e-3
    assert run_cli("verify", str(out)).code == 0
    q4 = tmp_path / "q4_0"
    r = run_cli("compile", str(src), "--scheme", "q4_0", "--target", "gguf", "-o", str(q4), "--quiet")
    assert r.code == 0, r.err
    f = open_gguf(q4 / "model.gguf")
    assert f.tensors["blk.0.ffn_up_exps.weight"].type_id == 2  # Q4_0
    assert f.tensors["blk.0.ffn_gate_inp.weight"].type_id == 0  # the router stays F32
    err = rel_l2(llama_cpp_logits(q4, IDS), logits(with_decode(model, q4)))
    print(f"llama.cpp Q4_0 vs the artifact's decode: rel-L2 {err:.2e}")
    assert err < 1e-2
    assert run_cli("verify", str(q4), "--level", "5").code == 0


def test_mixtral_through_safetensors_onnx_and_triton(tmp_path: Path) -> None:
    import onnxruntime as ort

    model = mixtral()
    src = tmp_path / "mixtral"
    model.save_pretrained(src)
    outs = {t: tmp_path / t for t in ("safetensors", "onnx-nbits", "triton")}
    for target, out in outs.items():
        r = run_cli("compile", str(src), "--scheme", "w4-g32", "--target", target, "-o", str(out), "--quiet")
        assert r.code == 0, (target, r.err)
        assert run_cli("verify", str(out), "--level", "5").code == 0, target
        assert "topk_mask" in (out / "graph.qir").read_text(), target
    want = logits(with_decode(model, outs["safetensors"]))
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
        outs["safetensors"],
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
        dtype=torch.float32,
        output_loading_info=True,
    )
    back, info = loaded
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    st = rel_l2(logits(back.eval()), want)
    sess = ort.InferenceSession(str(outs["onnx-nbits"] / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = prefill_feed(sess, np.array([IDS], dtype=np.int64))
    ort_err = rel_l2(np.asarray(sess.run(None, feeds)[0])[0].astype(np.float64), want)
    print(f"\ntransformers' dequantizing load vs the decode {st:.2e}; onnxruntime vs the decode {ort_err:.2e}")
    assert st < 1e-5
    assert ort_err < 1e-3
    float_out = tmp_path / "float-st"
    r = run_cli("compile", str(src), "--target", "safetensors", "-o", str(float_out), "--quiet")
    assert r.code == 0, r.err
    again: Any = transformers.AutoModelForCausalLM.from_pretrained(float_out, dtype=torch.float32)
    assert rel_l2(logits(again.eval()), logits(model)) == 0


@pytest.mark.parametrize("scheme", ["w4-g32", "q4_0"])
def test_each_expert_decodes_as_its_weight_quantized_alone(tmp_path: Path, scheme: str) -> None:
    """The stacked experts (gguf) and the per-expert weights (onnx-nbits) decode to exactly what
    quantizing each expert's ``[N, K]`` weight alone gives; the router stays float."""
    model = mixtral()
    src = tmp_path / "mixtral"
    model.save_pretrained(src)
    target = "gguf" if scheme == "q4_0" else "onnx-nbits"
    out = tmp_path / target
    assert run_cli("compile", str(src), "--scheme", scheme, "--target", target, "-o", str(out), "--quiet").code == 0
    decoded = artifact_decodes(out)
    dense = unfuse_experts(copy.deepcopy(model))
    experts = [n for n in decoded if ".experts." in n]
    assert len(experts) == 2 * 4 * 3
    assert not any(".gate." in n for n in decoded)
    for name in experts:
        w = dense.get_parameter(name).detach()
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data = w.clone()
        one = qcompiler.quantize(torch.nn.Sequential(lin), scheme)
        with torch.no_grad():  # x = I: the layer's output is its decoded weight, transposed (exact)
            alone_w = one(torch.eye(w.shape[1])).T.numpy()
        assert np.array_equal(decoded[name], alone_w), name


@pytest.mark.parametrize("experts", [4, 8])
@pytest.mark.parametrize(
    ("scheme", "ftype"), [("q4_k_m", "LLAMA_FTYPE_MOSTLY_Q4_K_M"), ("q5_k_m", "LLAMA_FTYPE_MOSTLY_Q5_K_M")]
)
def test_mixtral_mixture_equals_llama_model_quantize(tmp_path: Path, scheme: str, ftype: str, experts: int) -> None:
    """hidden and ff 256 (whole K-quant super-blocks): every tensor, the stacked ``ffn_*_exps`` included,
    has llama.cpp's type and bytes; the router ``ffn_gate_inp`` stays F32 as llama.cpp keeps it. With
    exactly 8 experts (Mixtral-8x7B's shape) llama.cpp's special case holds: attn_v and attn_k Q8_0,
    attn_output Q5_K in q4_k_m."""
    src = tmp_path / "mixtral"
    mixtral(256, 256, experts).save_pretrained(src)
    f32, ours = tmp_path / "f32", tmp_path / scheme
    assert run_cli("compile", str(src), "--target", "gguf", "-o", str(f32), "--quiet").code == 0
    r = run_cli("compile", str(src), "--scheme", scheme, "--target", "gguf", "-o", str(ours), "--quiet")
    assert r.code == 0, r.err
    theirs = assert_equals_llama_quantize(ours, f32, ftype, tmp_path)
    assert theirs["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    base = "Q4_K" if scheme == "q4_k_m" else "Q5_K"
    assert theirs["blk.1.ffn_down_exps.weight"].tensor_type.name == "Q6_K"  # a "more bits" layer
    assert theirs["blk.0.ffn_gate_exps.weight"].tensor_type.name == base
    eight = {"attn_v": "Q8_0", "attn_k": "Q8_0", "attn_output": "Q5_K" if scheme == "q4_k_m" else base}
    dense = {"attn_v": base, "attn_k": base, "attn_output": base}  # attn_v: layer 0 is not a "more bits" one
    for name, want in (eight if experts == 8 else dense).items():
        assert theirs[f"blk.0.{name}.weight"].tensor_type.name == want, name


QWEN_MOE: dict[str, tuple[Any, dict[str, Any]]] = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, {"head_dim": 32}),
    "qwen2_moe": (transformers.Qwen2MoeConfig, {"shared_expert_intermediate_size": 128}),
}
"""Each family's config class and its own fields; the model is ``AutoModelForCausalLM.from_config``."""


@pytest.mark.parametrize("family", sorted(QWEN_MOE))
def test_qwen_moe_through_the_graph_targets(family: str, tmp_path: Path) -> None:
    """Qwen3-MoE (top-k renormalised) and Qwen2-MoE (not renormalised; a shared expert behind a sigmoid
    gate): the dense form against transformers' eager MoE, and w4-g32 through onnx-nbits (onnxruntime
    against the artifact's decode), safetensors (transformers' dequantizing load) and triton (verify).
    Qwen2-MoE's ``shared_expert_gate`` (``[1, hidden]``) stays float like the router, as llama.cpp keeps it."""
    import onnxruntime as ort

    common = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    torch.manual_seed(0)
    config_class, own = QWEN_MOE[family]
    model: Any = transformers.AutoModelForCausalLM.from_config(config_class(**common, **own)).eval()
    model.set_experts_implementation("eager")
    err = rel_l2(logits(unfuse_experts(copy.deepcopy(model))), logits(model))
    src = tmp_path / family
    model.save_pretrained(src)
    outs = {t: tmp_path / t for t in ("safetensors", "onnx-nbits", "triton")}
    for target, out in outs.items():
        r = run_cli("compile", str(src), "--scheme", "w4-g32", "--target", target, "-o", str(out), "--quiet")
        assert r.code == 0, (target, r.err)
        assert run_cli("verify", str(out), "--level", "5").code == 0, target
    want = logits(with_decode(model, outs["onnx-nbits"]))
    sess = ort.InferenceSession(str(outs["onnx-nbits"] / "model.onnx"), providers=["CPUExecutionProvider"])
    ort_err = rel_l2(np.asarray(sess.run(None, prefill_feed(sess, np.array([IDS], dtype=np.int64)))[0])[0], want)
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
        outs["safetensors"],
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
        dtype=torch.float32,
        output_loading_info=True,
    )
    back, info = loaded
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    st = rel_l2(logits(back.eval()), want)
    print(f"\n{family}: dense vs eager {err:.2e}; onnxruntime {ort_err:.2e}, transformers' load {st:.2e} vs the decode")
    assert err < 1e-5
    assert ort_err < 1e-3
    assert st < 1e-5

"""Decoder families beside Llama through every target: Qwen2 (q/k/v biases, tied embeddings), Qwen3
(q/k RMS norms, its own head size, tied embeddings) and Mistral (llama's graph in llama.cpp).

Tiny random models saved by ``save_pretrained``. GGUF: the float compile run by llama.cpp gives
transformers' logits; a ``q4_0`` compile run by llama.cpp gives the logits of the model whose
Linear weights are the artifact's own decode; ``verify`` passes; and the ``.gguf`` read back as a
SOURCE re-emits the same file byte for byte. safetensors (transformers' dequantizing load),
onnx-nbits (onnxruntime) and triton (``verify``: the graph probe and the kernels' AOT build): a
``w4-g32`` compile gives the logits of the model with the artifact's own decode."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from prequant_packers import artifact_decodes, assert_equals_llama_quantize, rel_l2

from qcompiler.backends.gguf.reader import open_gguf
from qcompiler.backends.gguf.source_config import CONFIG_KEYS
from qcompiler.backends.onnx.feeds import prefill_feed, teacher_forced
from qcompiler.testing import run_cli

IDS = [1, 5, 9, 33, 2, 7, 100, 4]
COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def made(model: Any, config: Any, **fixed: Any) -> Callable[..., Any]:
    """A factory of tiny random ``model``s: ``COMMON``, then ``fixed``, then the call's overrides."""

    def make(**over: Any) -> Any:
        return model(config(**{**COMMON, **fixed, **over}))

    return make


FAMILIES: dict[str, tuple[str, Callable[..., Any]]] = {
    "qwen2": ("qwen2", made(transformers.Qwen2ForCausalLM, transformers.Qwen2Config)),
    "qwen3": ("qwen3", made(transformers.Qwen3ForCausalLM, transformers.Qwen3Config, head_dim=32)),
    "gemma": ("gemma", made(transformers.GemmaForCausalLM, transformers.GemmaConfig, head_dim=16)),
    "gemma3": (
        "gemma3",
        made(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig, head_dim=16, query_pre_attn_scalar=16),
    ),
    "mistral": ("llama", made(transformers.MistralForCausalLM, transformers.MistralConfig, sliding_window=None)),
}
"""family -> (llama.cpp architecture, a tiny random model of it with config overrides)."""


Q8_ACTIVATIONS = {"gemma3": 3e-2}
"""llama.cpp's Q4_0 matmuls round activations to Q8_0: its error against the artifact's decode in
float. For Gemma3 (four norms a layer) it is 1.75e-2 rel-L2 here, while an F32 GGUF of the same
decoded weights is 5.9e-4 from the model: the weights and graph agree, the rest is the kernel's."""


def llama_cpp_logits(path: Path, ids: list[int] = IDS) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path / "model.gguf"), logits_all=True, n_ctx=64, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def logits(model: Any) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([IDS])).logits[0].double().numpy()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_llama_cpp_runs_the_family(family: str, tmp_path: Path) -> None:
    arch, make = FAMILIES[family]
    torch.manual_seed(0)
    model = make().eval()
    src = tmp_path / family
    model.save_pretrained(src)
    out = tmp_path / "f32"
    r = run_cli("compile", str(src), "--target", "gguf", "-o", str(out), "--quiet")
    assert r.code == 0, r.err
    assert open_gguf(out / "model.gguf").metadata["general.architecture"][1] == arch
    assert rel_l2(llama_cpp_logits(out), logits(model)) < 2e-3
    q4 = tmp_path / "q4_0"
    r = run_cli("compile", str(src), "--scheme", "q4_0", "--target", "gguf", "-o", str(q4), "--quiet")
    assert r.code == 0, r.err
    decoded = artifact_decodes(q4)
    assert decoded
    for name, values in decoded.items():
        model.get_parameter(name).data = torch.from_numpy(values.astype(np.float32))
    assert rel_l2(llama_cpp_logits(q4), logits(model)) < Q8_ACTIVATIONS.get(family, 1e-2)
    assert run_cli("verify", str(q4), "--level", "5").code == 0
    if arch not in CONFIG_KEYS:  # not importable as a SOURCE yet
        return
    again = tmp_path / "again"
    r = run_cli("compile", str(q4 / "model.gguf"), "--target", "gguf", "-o", str(again), "--quiet")
    assert r.code == 0, r.err
    assert (again / "model.gguf").read_bytes() == (q4 / "model.gguf").read_bytes()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_family_through_safetensors_onnx_and_triton(family: str, tmp_path: Path) -> None:
    import onnxruntime as ort

    torch.manual_seed(0)
    model = FAMILIES[family][1]().eval()
    src = tmp_path / family
    model.save_pretrained(src)
    outs = {t: tmp_path / t for t in ("safetensors", "onnx-nbits", "triton")}
    for target, out in outs.items():
        r = run_cli("compile", str(src), "--scheme", "w4-g32", "--target", target, "-o", str(out), "--quiet")
        assert r.code == 0, (target, r.err)
        assert run_cli("verify", str(out), "--level", "5").code == 0, target
    for name, values in artifact_decodes(outs["safetensors"]).items():
        model.get_parameter(name).data = torch.from_numpy(values.astype(np.float32))
    want = logits(model)
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
        outs["safetensors"],
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
        dtype=torch.float32,
        output_loading_info=True,
    )
    back, info = loaded
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    assert rel_l2(logits(back.eval()), want) < 1e-5
    sess = ort.InferenceSession(str(outs["onnx-nbits"] / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = prefill_feed(sess, np.array([IDS], dtype=np.int64))
    assert rel_l2(np.asarray(sess.run(None, feeds)[0])[0].astype(np.float64), want) < 1e-3


def test_capture_takes_a_transformers_model_as_users_call_it() -> None:
    """``qcompiler.capture(model, (input_ids,))`` on a causal LM with its default ``use_cache=True``
    (the README's snippet): the cache is off while it is exported, and on again after."""
    import qcompiler

    torch.manual_seed(0)
    model = FAMILIES["qwen2"][1]().eval()
    assert model.config.use_cache
    m = qcompiler.capture(
        qcompiler.quantize(model, "w4-g32"), (torch.tensor([IDS]),), dynamic={"input_ids": {1: "seq"}}
    )
    ret = m.graphs[0].ops[-1]
    assert [str(v.type) for v in ret.operands] == ["tensor<f32[1,?seq,256]>"]
    assert model.config.use_cache


WINDOWED: dict[str, Any] = {
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=6)),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(**COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=6)
    ),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**COMMON, pad_token_id=0, sliding_window=6)),
}
UNWINDOWED_GGUF = {"mistral": "llama", "phi3": "phi3"}
"""Families whose llama.cpp graph has no window, so the gguf target refuses a windowed one. llama.cpp's
phi3 graph reads ``phi3.attention.sliding_window`` but does not slide (llama-cpp-python 0.3.36: a
windowed tiny Phi-3 is 0.56 rel-L2 from transformers' logits at 24 tokens, 1.5e-4 from the same model
without the window)."""


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_a_sliding_window_is_kept_by_every_graph_target(family: str, tmp_path: Path) -> None:
    """A sliding window (6) shorter than the context: the exported mask is recognised at a length past
    it, and ``sdpa {window = 6}`` means it in every graph target. At 24 tokens (4x the window),
    onnxruntime's decoder graph (``model.onnx``) over the whole sequence and decoding one token at a
    time through its cache after 10, transformers' dequantizing load and the CPU runtime
    (``verify --level 5``) all give the logits of the model holding the artifact's own decode.
    llama.cpp's llama and phi3 graphs have no window: the gguf target refuses Mistral's and Phi-3's,
    naming the field."""
    import onnxruntime as ort

    torch.manual_seed(0)
    model = WINDOWED[family]().eval()
    src = tmp_path / family
    model.save_pretrained(src)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    if family == "gemma3":  # llama.cpp's gemma3 graph slides too: its F32 compile gives the float logits
        out = tmp_path / "gguf"
        assert run_cli("compile", str(src), "--target", "gguf", "-o", str(out), "--quiet").code == 0
        with torch.no_grad():
            float_logits = model(input_ids=ids).logits[0].double().numpy()
        assert rel_l2(llama_cpp_logits(out, ids[0].tolist()), float_logits) < 2e-3
    outs = {t: tmp_path / t for t in ("safetensors", "onnx-nbits", "triton")}
    for target, out in outs.items():
        r = run_cli("compile", str(src), "--scheme", "w4-g32", "--target", target, "-o", str(out), "--quiet")
        assert r.code == 0, (target, r.err)
        assert "window = 6" in (out / "graph.qir").read_text(), target
        assert run_cli("verify", str(out), "--level", "5").code == 0, target
    for name, values in artifact_decodes(outs["safetensors"]).items():
        model.get_parameter(name).data = torch.from_numpy(values.astype(np.float32))
    with torch.no_grad():
        want = model(input_ids=ids).logits[0].double().numpy()
        causal = type(model.config)(**{**model.config.to_dict(), "sliding_window": 4096})
    back: Any = transformers.AutoModelForCausalLM.from_pretrained(
        outs["safetensors"],
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
        dtype=torch.float32,
    )
    with torch.no_grad():
        assert rel_l2(back.eval()(input_ids=ids).logits[0].double().numpy(), want) < 1e-5
    opts = ["CPUExecutionProvider"]
    sess = ort.InferenceSession(str(outs["onnx-nbits"] / "model.onnx"), providers=opts)
    assert rel_l2(np.asarray(sess.run(None, prefill_feed(sess, ids.numpy()))[0])[0].astype(np.float64), want) < 1e-3
    assert rel_l2(teacher_forced(sess, ids.numpy(), 10)[0].astype(np.float64), want) < 1e-3
    assert causal.sliding_window == 4096  # the window is what differs from plain causal attention:
    plain: Any = type(model)(causal).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert rel_l2(plain(input_ids=ids).logits[0].double().numpy(), want) > 1e-3
    if family in UNWINDOWED_GGUF:
        out = tmp_path / "gguf"
        r = run_cli("compile", str(src), "--target", "gguf", "-o", str(out), "--quiet")
        assert r.code == 1, r.err
        assert "Traceback" not in r.err
        for word in ("sliding_window (6 < max_position_embeddings 128)", f"llama.cpp's {UNWINDOWED_GGUF[family]}"):
            assert word in r.err, r.err
        assert not out.exists()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma", "gemma3"])
def test_q4_k_m_equals_llama_model_quantize(family: str, tmp_path: Path) -> None:
    """Hidden and FFN width 256 (whole K-quant super-blocks; attn_output's K of heads x head_dim is
    not, so it takes llama.cpp's fallback): ``--scheme q4_k_m`` gives every tensor the type and the
    bytes ``llama_model_quantize`` gives it from our F32 file. The tied head is ``token_embd`` in Q6_K."""
    src, ours, f32 = tmp_path / "src", tmp_path / "ours", tmp_path / "f32"
    torch.manual_seed(0)
    FAMILIES[family][1](hidden_size=256, intermediate_size=256).save_pretrained(src)
    for out, scheme in ((ours, ["--scheme", "q4_k_m"]), (f32, [])):
        r = run_cli("compile", str(src), *scheme, "--target", "gguf", "-o", str(out), "--quiet")
        assert r.code == 0, r.err
    theirs = assert_equals_llama_quantize(ours, f32, "LLAMA_FTYPE_MOSTLY_Q4_K_M", tmp_path)
    assert theirs["token_embd.weight"].tensor_type.name == ("Q4_K" if "output.weight" in theirs else "Q6_K")
    assert run_cli("verify", str(ours)).code == 0


def test_an_unsupported_family_is_refused_when_config_json_is_read(tmp_path: Path) -> None:
    """OPT (learned positions through ``aten.ones``/``cumsum``) and ViT (an image encoder) are not
    supported families: every target refuses them from config.json, naming the class and listing the
    supported families, before transformers builds anything; no traceback, no output."""
    from qcompiler.frontend.families import FAMILIES

    torch.manual_seed(0)
    opt = transformers.OPTConfig(
        vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=1, num_attention_heads=4, word_embed_proj_dim=64
    )
    transformers.OPTForCausalLM(opt).save_pretrained(tmp_path / "opt")
    vit = transformers.ViTConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, image_size=32, patch_size=8
    )
    transformers.ViTModel(vit).save_pretrained(tmp_path / "vit")
    for name, cls in (("opt", "OPTForCausalLM"), ("vit", "ViTModel")):
        for target in ("safetensors", "gguf", "onnx-nbits", "triton"):
            out = tmp_path / f"{name}-{target}"
            r = run_cli("compile", str(tmp_path / name), "--target", target, "-o", str(out), "--quiet")
            assert r.code == 1, r.err
            assert "Traceback" not in r.err
            words = [f"{name}/config.json: model_type: {cls} is not a supported model family", f"found {name}"]
            for word in words + [f"{family} ({t})" for t, family in FAMILIES.items()]:
                assert word in r.err, r.err
            assert not out.exists()


def test_gguf_refuses_what_it_cannot_write_before_the_capture(tmp_path: Path) -> None:
    """An architecture this compiler does not take (OPT) and YaRN RoPE scaling (llama.cpp needs
    ``rope.scaling`` keys this target does not write) are refused from config.json before anything is
    captured; the float graph targets still take the Llama."""
    torch.manual_seed(0)
    opt = transformers.OPTConfig(
        vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=1, num_attention_heads=4, word_embed_proj_dim=64
    )
    transformers.OPTForCausalLM(opt).save_pretrained(tmp_path / "opt")
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    over: dict[str, Any] = {"max_position_embeddings": 256, "rope_parameters": yarn}
    cfg = transformers.LlamaConfig(**{**COMMON, **over})
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "yarn")
    cases = {
        "opt": ["OPTForCausalLM is not a supported model family", "Qwen2"],
        "yarn": ["RoPE scaling 'yarn'", "llama.cpp's llama graph", "rope.scaling keys; written: llama3"],
    }
    for name, words in cases.items():
        out = tmp_path / f"{name}-gguf"
        r = run_cli("compile", str(tmp_path / name), "--target", "gguf", "-o", str(out), "--quiet")
        assert r.code == 1, r.err
        assert "Traceback" not in r.err
        for word in words:
            assert word in r.err, r.err
        assert not out.exists()
    out = tmp_path / "yarn-st"
    assert run_cli("compile", str(tmp_path / "yarn"), "--target", "safetensors", "-o", str(out), "--quiet").code == 0

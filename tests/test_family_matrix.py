"""Every family x target of docs/architectures.md, one cell per test: the float compile reproduces the
float model through the target's real peer (rel-L2 of the logits <= 2e-3; llama.cpp's F32 <= 1e-2)
and passes ``verify --level 5`` (the CPU runtime's rungs). The quantized half of each cell (w4-g32,
or Q4_0 / q4_k_m for gguf, against the artifact's own decode, and ``verify --level 5``) is in the
per-family files (``test_families.py``, ``test_family_*.py``), with each cell's particulars.

Peers: transformers loading the safetensors artifact, onnxruntime running ``model.onnx``, llama.cpp
running ``model.gguf``; the triton target's peer is ``verify`` (the graph probe, the kernels'
interpreter parity and the CPU runtime). Models: hidden 64, 2 layers, 4 heads, vocab 256 (BERT's
llama.cpp cell is tested by its own file, ``test_gguf_backend.py``, with a real tokenizer)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from prequant_packers import IDS, rel_l2

from qcompiler.backends.onnx.feeds import prefill_feed
from qcompiler.testing import run_cli

COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
MOE: dict[str, Any] = {"moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2}


def made(model: Any, config: Any, **fixed: Any) -> Callable[[], Any]:
    def make() -> Any:
        torch.manual_seed(0)
        return model(config(**{**COMMON, **fixed})).eval()

    return make


FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": made(transformers.LlamaForCausalLM, transformers.LlamaConfig),
    "mistral": made(transformers.MistralForCausalLM, transformers.MistralConfig, sliding_window=None),
    "qwen2": made(transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
    "qwen3": made(transformers.Qwen3ForCausalLM, transformers.Qwen3Config, head_dim=32),
    "gemma": made(transformers.GemmaForCausalLM, transformers.GemmaConfig, head_dim=16),
    "gemma2": made(
        transformers.Gemma2ForCausalLM,
        transformers.Gemma2Config,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=6,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "gemma3": made(
        transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig, head_dim=16, query_pre_attn_scalar=16
    ),
    "phi3": made(transformers.Phi3ForCausalLM, transformers.Phi3Config, pad_token_id=0),
    "mixtral": made(transformers.MixtralForCausalLM, transformers.MixtralConfig, num_local_experts=4),
    "qwen2_moe": made(
        transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig, **MOE, shared_expert_intermediate_size=128
    ),
    "qwen3_moe": made(
        transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig, **MOE, head_dim=32, norm_topk_prob=True
    ),
}
"""family -> a tiny random causal LM (GPT-2 and BERT below: their configs name sizes otherwise)."""
FAMILIES["gpt2"] = lambda: (
    torch.manual_seed(0),
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4)).eval(),
)[1]
FAMILIES["bert"] = lambda: (
    torch.manual_seed(0),
    transformers.BertModel(
        transformers.BertConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
        )
    ).eval(),
)[1]
TARGETS = ("safetensors", "onnx-nbits", "gguf", "triton")
NOT_A_CELL = {("bert", "gguf")}
"""BERT's llama.cpp cell needs a tokenizer: ``test_gguf_backend.py::test_minilm_sentence_embeddings_in_llama_cpp``
runs all-MiniLM-L6-v2's F32 compile (and Q8_0, Q4_0) through llama.cpp against transformers."""


def outputs(model: Any) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([IDS]))
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state)[0].double().numpy()


def peer(target: str, family: str, out: Path) -> np.ndarray | None:
    """The float artifact's outputs through the target's real peer (``None`` for triton: ``verify``)."""
    if target == "safetensors":
        auto = transformers.AutoModel if family == "bert" else transformers.AutoModelForCausalLM
        return outputs(auto.from_pretrained(out, dtype=torch.float32).eval())
    if target == "onnx-nbits":
        import onnxruntime as ort

        sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
        return np.asarray(sess.run(None, prefill_feed(sess, np.array([IDS], dtype=np.int64)))[0])[0].astype(np.float64)
    if target == "gguf":
        from llama_cpp import Llama

        llm = Llama(model_path=str(out / "model.gguf"), logits_all=True, n_ctx=64, verbose=False)
        llm.eval(IDS)
        return np.array(llm.scores[: len(IDS)], dtype=np.float64)
    return None


CELLS = [(f, t) for f in sorted(FAMILIES) for t in TARGETS if (f, t) not in NOT_A_CELL]


@pytest.mark.parametrize(("family", "target"), CELLS)
def test_cell(family: str, target: str, tmp_path: Path) -> None:
    model = FAMILIES[family]()
    src = tmp_path / "src"
    model.save_pretrained(src)
    out = tmp_path / "float"
    r = run_cli("compile", str(src), "--target", target, "-o", str(out), "--quiet")
    assert r.code == 0, r.err
    r = run_cli("verify", str(out), "--level", "5")
    assert r.code == 0, (r.out[-2000:], r.err)
    got = peer(target, family, out)
    if got is not None:
        rel = rel_l2(got, outputs(model))
        print(f"{family} {target} float: the peer vs transformers rel-L2 {rel:.2e}")
        assert rel <= (1e-2 if target == "gguf" else 2e-3)

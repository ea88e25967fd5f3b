"""Qwen3-MoE and Qwen2-MoE through the gguf target: llama.cpp's ``qwen3moe`` and ``qwen2moe``.

Tiny random models (hidden 64, moe_intermediate_size 128, 4 experts, top-2, 2 layers, vocab 256) built
from transformers configs and saved by ``save_pretrained``. Checked: the metadata keys and stacked
``ffn_*_exps`` (and qwen2moe's shared expert ``ffn_*_shexp``, its gate ``ffn_gate_inp_shexp`` F32) as
llama.cpp's converter writes them; llama.cpp (llama-cpp-python) against transformers (F32) and against
the model holding the artifact's own decode (Q4_0); ``verify``; ``q4_k_m``/``q5_k_m`` equal to
``llama_model_quantize`` byte for byte; the configs these graphs cannot compute refused by field before
the capture. ``-s`` prints the measured numbers.
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

from qcompiler.backends.gguf.reader import open_gguf
from qcompiler.quant.experts import unfuse_experts
from qcompiler.testing import run_cli

IDS = [1, 5, 9, 33, 2, 7, 100, 4]
FAMILIES: dict[str, tuple[Any, str, dict[str, Any]]] = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, "qwen3moe", {"head_dim": 32, "norm_topk_prob": True}),
    "qwen2_moe": (transformers.Qwen2MoeConfig, "qwen2moe", {}),
}
"""Each family's config class, llama.cpp architecture and own fields (Qwen3-MoE as its checkpoints
ship: top-k renormalised, which llama.cpp's qwen3moe graph always does)."""


def qwen_moe(family: str, hidden: int = 64, ff: int = 128, **over: Any) -> Any:
    config_class, _, own = FAMILIES[family]
    fields = {
        "vocab_size": 256,
        "hidden_size": hidden,
        "intermediate_size": ff,
        "moe_intermediate_size": ff,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        **own,
        **({"shared_expert_intermediate_size": ff} if family == "qwen2_moe" else {}),
        **over,
    }
    torch.manual_seed(0)
    model: Any = transformers.AutoModelForCausalLM.from_config(config_class(**fields)).eval()
    return model


def logits(model: Any) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([IDS])).logits[0].double().numpy()


def with_decode(model: Any, artifact: Path) -> Any:
    """``model`` (its experts unfused) holding the artifact's own decode of every quantized weight."""
    model = unfuse_experts(copy.deepcopy(model))
    decoded = artifact_decodes(artifact)
    assert decoded
    for name, values in decoded.items():
        model.get_parameter(name).data = torch.from_numpy(values.astype(np.float32))
    return model


def compile_gguf(src: Path, out: Path, scheme: str | None = None) -> None:
    extra = ("--scheme", scheme) if scheme else ()
    r = run_cli("compile", str(src), *extra, "--target", "gguf", "-o", str(out), "--quiet")
    assert r.code == 0, r.err


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_llama_cpp_runs_qwen_moe(family: str, tmp_path: Path) -> None:
    arch = FAMILIES[family][1]
    model = qwen_moe(family)
    src = tmp_path / family
    model.save_pretrained(src)
    out = tmp_path / "f32"
    compile_gguf(src, out)
    f = open_gguf(out / "model.gguf")
    meta = {k: v[1] for k, v in f.metadata.items()}
    assert meta["general.architecture"] == arch
    assert (meta[f"{arch}.expert_count"], meta[f"{arch}.expert_used_count"]) == (4, 2)
    assert meta[f"{arch}.expert_feed_forward_length"] == 128
    assert f.tensors["blk.0.ffn_gate_inp.weight"].shape == (4, 64)
    assert f.tensors["blk.0.ffn_gate_exps.weight"].shape == (4, 128, 64)
    assert f.tensors["blk.1.ffn_up_exps.weight"].shape == (4, 128, 64)
    assert f.tensors["blk.1.ffn_down_exps.weight"].shape == (4, 64, 128)
    assert "blk.0.ffn_gate.weight" not in f.tensors
    if arch == "qwen3moe":
        assert (meta["qwen3moe.attention.key_length"], meta["qwen3moe.attention.value_length"]) == (32, 32)
        assert f.tensors["blk.0.attn_q_norm.weight"].shape == (32,)
        assert not any("shexp" in n for n in f.tensors)
    else:
        assert meta["qwen2moe.expert_shared_feed_forward_length"] == 128
        assert f.tensors["blk.0.attn_q.bias"].shape == (64,)
        assert f.tensors["blk.1.ffn_gate_shexp.weight"].shape == (128, 64)
        assert f.tensors["blk.1.ffn_down_shexp.weight"].shape == (64, 128)
        assert f.tensors["blk.1.ffn_gate_inp_shexp.weight"].shape == (64,)  # 1-D, as llama.cpp declares it
    f32_err = rel_l2(llama_cpp_logits(out, IDS), logits(model))
    assert run_cli("verify", str(out)).code == 0
    q4 = tmp_path / "q4_0"
    compile_gguf(src, q4, "q4_0")
    f = open_gguf(q4 / "model.gguf")
    assert f.tensors["blk.0.ffn_up_exps.weight"].type_id == 2  # Q4_0
    assert f.tensors["blk.0.ffn_gate_inp.weight"].type_id == 0  # the router stays F32
    if arch == "qwen2moe":
        assert f.tensors["blk.0.ffn_down_shexp.weight"].type_id == 2  # the shared expert quantizes
        assert f.tensors["blk.0.ffn_gate_inp_shexp.weight"].type_id == 0  # its gate stays F32
    decoded = with_decode(model, q4)
    q4_err = rel_l2(llama_cpp_logits(q4, IDS), logits(decoded))
    print(f"\n{family}: llama.cpp F32 vs transformers {f32_err:.2e}; Q4_0 vs the artifact's decode {q4_err:.2e}")
    assert f32_err < 1e-2
    assert q4_err < 1e-2
    assert run_cli("verify", str(q4), "--level", "5").code == 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(
    ("scheme", "ftype"), [("q4_k_m", "LLAMA_FTYPE_MOSTLY_Q4_K_M"), ("q5_k_m", "LLAMA_FTYPE_MOSTLY_Q5_K_M")]
)
def test_qwen_moe_mixture_equals_llama_model_quantize(tmp_path: Path, family: str, scheme: str, ftype: str) -> None:
    """hidden, moe_intermediate_size and the shared expert 256 (whole K-quant super-blocks), 4 experts:
    every tensor has llama.cpp's type and bytes; the router and qwen2moe's shared-expert gate stay F32."""
    src = tmp_path / family
    qwen_moe(family, 256, 256).save_pretrained(src)
    f32, ours = tmp_path / "f32", tmp_path / scheme
    compile_gguf(src, f32)
    compile_gguf(src, ours, scheme)
    theirs = assert_equals_llama_quantize(ours, f32, ftype, tmp_path)
    types = {n: t.tensor_type.name for n, t in theirs.items() if n.startswith(("blk.0.", "blk.1."))}
    print(f"\n{family} {scheme}: " + ", ".join(f"{n} {t}" for n, t in sorted(types.items()) if "norm" not in n))
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"
    base = "Q4_K" if scheme == "q4_k_m" else "Q5_K"
    assert types["blk.0.ffn_gate_exps.weight"] == base
    assert types["blk.1.ffn_down_exps.weight"] == "Q6_K"  # a "more bits" layer
    if family == "qwen2_moe":
        assert types["blk.0.ffn_gate_inp_shexp.weight"] == "F32"
        assert types["blk.0.ffn_up_shexp.weight"] == base
        assert types["blk.1.ffn_down_shexp.weight"] == "Q6_K"  # counted as ffn_down


REFUSED: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("qwen3_moe", {"norm_topk_prob": False}, ("norm_topk_prob", "always renormalises")),
    ("qwen2_moe", {"norm_topk_prob": True}, ("norm_topk_prob", "never renormalises")),
    ("qwen3_moe", {"decoder_sparse_step": 2}, ("decoder_sparse_step 2",)),
    ("qwen2_moe", {"mlp_only_layers": [1]}, ("mlp_only_layers [1]",)),
    ("qwen3_moe", {"attention_bias": True}, ("attention_bias",)),
    ("qwen2_moe", {"tie_word_embeddings": True}, ("tie_word_embeddings", "output.weight")),
]


@pytest.mark.parametrize(("family", "over", "words"), REFUSED, ids=[f"{f}-{next(iter(o))}" for f, o, _ in REFUSED])
def test_what_the_moe_graphs_fix_is_refused_by_field(
    tmp_path: Path, family: str, over: dict[str, Any], words: tuple[str, ...]
) -> None:
    """A config llama.cpp's qwen3moe/qwen2moe graph would compute differently: refused from config.json,
    naming the field, before the capture; no traceback, no artifact."""
    src = tmp_path / family
    qwen_moe(family, **over).save_pretrained(src)
    out = tmp_path / "out"
    r = run_cli("compile", str(src), "--target", "gguf", "-o", str(out), "--quiet")
    assert r.code != 0
    assert "Traceback" not in r.err
    for word in (FAMILIES[family][1], *words):
        assert word in r.err, r.err
    assert not out.exists()

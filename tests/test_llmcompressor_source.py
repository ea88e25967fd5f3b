"""Checkpoints written by llmcompressor itself as sources. llmcompressor 0.14 pins transformers 5.17, so
it runs in its own venv, which ``.ci/run`` creates and names in ``QC_PEER_LLMCOMPRESSOR`` (its python).

A tiny random bf16 Llama is quantized there by ``oneshot`` (RTN ``QuantizationModifier`` W4A16 and
W4A16_ASYM; ``GPTQModifier`` W4A16 on a few random calibration sequences, plain and with
``actorder="weight"``) and saved compressed. Each checkpoint is compiled here: to compressed-tensors
every stored tensor comes back byte for byte; to GGUF and Triton the codes are kept; each artifact's
peer (transformers' dequantizing load, llama.cpp, Triton's interpreter through ``verify``) agrees
with the reference: the float model with each quantized weight set to the checkpoint's decode, read
with compressed-tensors' own unpacker."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from prequant_packers import IDS, assert_decodes_equal_reference, logits, rel_l2
from safetensors.torch import load_file

from qcompiler.testing import run_cli

PYTHON = os.environ.get("QC_PEER_LLMCOMPRESSOR", "")
pytestmark = pytest.mark.skipif(
    not PYTHON,
    reason="llmcompressor pins transformers 5.17: it runs in its own venv, which .ci/run creates "
    "(QC_PEER_LLMCOMPRESSOR names its python)",
)

MAKE = """
import sys
import torch, transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

out, kind = sys.argv[1], sys.argv[2]
cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
torch.manual_seed(0)
transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out + ".float")
tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))  # GPTQ wants a processor
tok.pre_tokenizer = pre_tokenizers.Whitespace()
fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t1")
fast.save_pretrained(out + ".float")
model = transformers.AutoModelForCausalLM.from_pretrained(out + ".float", dtype=torch.bfloat16)
if kind.startswith("gptq"):
    from datasets import Dataset
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    order = "weight" if kind == "gptq-actorder" else None
    recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"], actorder=order)
    oneshot(model=model, recipe=recipe, dataset=ds, num_calibration_samples=8, max_seq_length=32)
else:
    scheme = {"rtn-asym": "W4A16_ASYM", "fp8-dynamic": "FP8_DYNAMIC"}.get(kind, "W4A16")
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
model.save_pretrained(out, save_compressed=True)
"""
KINDS = ("rtn", "rtn-asym", "gptq", "gptq-actorder")
"""Integer W4A16 checkpoints; ``fp8-dynamic`` (``FP8_DYNAMIC``: FP8 weights per channel, dynamic
per-token FP8 activations) is read too."""


def reference(path: Path) -> Any:
    """The float model with every quantized Linear's weight the checkpoint's decode ``(q - z) * s``
    in float32, read with compressed-tensors' own unpacker (FP8: ``float32(w) * s``, torch's float8)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(Path(f"{path}.float"), dtype=torch.float32)
    wargs = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    bits = wargs["weights"]["num_bits"]
    tensors = load_file(str(path / "model.safetensors"))
    for name, mod in list(model.named_modules()):
        fp8 = tensors.get(f"{name}.weight")
        if fp8 is not None and fp8.dtype == torch.float8_e4m3fn:
            mod.weight.data = fp8.float() * tensors[f"{name}.weight_scale"].float()
            continue
        if f"{name}.weight_packed" not in tensors:
            continue
        n, k = mod.weight.shape
        q = unpack_from_int32(tensors[f"{name}.weight_packed"], bits, torch.Size([n, k])).to(torch.int64)
        s = tensors[f"{name}.weight_scale"].float()
        z = torch.zeros_like(s, dtype=torch.int64)
        if f"{name}.weight_zero_point" in tensors:
            zp = tensors[f"{name}.weight_zero_point"]
            z = unpack_from_int32(zp, bits, torch.Size([n, s.shape[1]]), packed_dim=0).to(torch.int64)
        size = k // s.shape[1]
        mod.weight.data = (q - z.repeat_interleave(size, 1)).float() * s.repeat_interleave(size, 1)
    return model.eval()


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("llmc")
    script = root / "make.py"
    script.write_text(MAKE)
    cache: dict[str, tuple[Path, Any]] = {}

    def get(kind: str) -> tuple[Path, Any]:
        if kind not in cache:
            out = root / kind
            r = subprocess.run([PYTHON, str(script), str(out), kind], capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, r.stderr[-3000:]
            cache[kind] = (out, reference(out))
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", [*KINDS, "fp8-dynamic"])
def test_llmcompressor_checkpoint_reemits_byte_identical(
    made: Callable[[str], tuple[Path, Any]], tmp_path: Path, kind: str
) -> None:
    src, ref = made(kind)
    out = tmp_path / "ct"
    r = run_cli("compile", str(src), "--target", "safetensors", "-o", str(out), "--quiet")
    assert r.code == 0, r.err
    assert json.loads((out / "manifest.json").read_text())["conversions"] == []
    before, after = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(before) == set(after)
    for key, t in before.items():
        assert t.dtype == after[key].dtype, key
        assert torch.equal(t.view(-1).view(torch.uint8), after[key].view(-1).view(torch.uint8)), key
    assert_decodes_equal_reference(out, ref)
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=transformers.CompressedTensorsConfig(dequantize=True), dtype=torch.float32
    )
    assert rel_l2(logits(loaded.eval()), logits(ref)) < 5e-3


@pytest.mark.parametrize("kind", KINDS)
def test_llmcompressor_checkpoint_into_gguf_and_triton(
    made: Callable[[str], tuple[Path, Any]], tmp_path: Path, kind: str
) -> None:
    """GGUF: the bf16 scales become f16 (a conversion, refused unless allowed, measured); groups of
    128 repeat their scale per block; asymmetric weights become Q4_1. Triton holds it all exactly."""
    from llama_cpp import Llama

    src, ref = made(kind)
    r = run_cli("compile", str(src), "--target", "gguf", "-o", str(tmp_path / "no"), "--quiet")
    assert r.code == 1
    assert "f16 scales, not bf16" in r.err, r.err
    out = tmp_path / "gguf"
    r = run_cli("compile", str(src), "--target", "gguf", "-o", str(out), "--quiet", "--allow-conversion")
    assert r.code == 0, r.err
    kinds = {c["kind"] for c in json.loads((out / "manifest.json").read_text())["conversions"]}
    assert kinds >= {"scale-dtype", "regroup"}
    assert ("affine-min" in kinds) == (kind == "rtn-asym")
    llm = Llama(model_path=str(out / "model.gguf"), logits_all=True, n_ctx=64, verbose=False)
    llm.eval(IDS)
    assert rel_l2(np.array(llm.scores[: len(IDS)], dtype=np.float64), logits(ref)) < 3e-2
    out = tmp_path / "triton"
    r = run_cli("compile", str(src), "--target", "triton", "-o", str(out), "--quiet")
    assert r.code == 0, r.err
    assert json.loads((out / "manifest.json").read_text())["conversions"] == []
    assert_decodes_equal_reference(out, ref)
    assert run_cli("verify", str(out)).code == 0

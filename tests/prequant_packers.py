"""Shared by the tests of pre-quantized sources (tests/test_prequant_*.py, test_onnx_act_order.py,
test_llmcompressor_source.py): an independent GPTQ/AWQ packer written from the published layouts
(AutoGPTQ's and AutoAWQ's pack loops, not qcompiler's reader), the tiny Llama they quantize, a
compressed-tensors checkpoint written by compressed-tensors' own lifecycle, the per-module cache of
written sources, and the checks they share. Importable because pyproject's ``pythonpath`` lists
``tests``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from qcompiler.artifact.reader import open_artifact
from qcompiler.parity import decoded, weights
from qcompiler.testing import run_cli

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
IDS = [int(i) for i in np.random.default_rng(0).integers(0, 256, 24)]
"""The token ids every logits comparison runs."""


def rtn_unsigned(
    w: np.ndarray, bits: int, group: int, sym: bool, pow2: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unsigned codes q [N, K], zeros z [N, G], fp16 scales s [N, G] with W ~ s * (q - z) (``pow2``:
    scales rounded up to powers of two, so every ``s * z`` is an f16)."""
    n, k = w.shape
    maxq = (1 << bits) - 1
    g = w.reshape(n, k // group, group).astype(np.float32)
    if sym:
        amax = np.abs(g).max(-1)
        s = (2 * amax / maxq).astype(np.float16)
        s = np.where(s == 0, np.float16(1), s)
        z = np.full(s.shape, (maxq + 1) // 2, dtype=np.int64)
    else:
        lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
        s = ((hi - lo) / maxq).astype(np.float16)
        s = np.where(s == 0, np.float16(1), s)
        s = np.exp2(np.ceil(np.log2(s.astype(np.float32)))).astype(np.float16) if pow2 else s
        z = np.clip(np.round(-lo / s.astype(np.float32)), 0, maxq).astype(np.int64)
    q = np.clip(np.round(g / s.astype(np.float32)[..., None]) + z[..., None], 0, maxq).astype(np.int64)
    return q.reshape(n, k), z, s


def pack_gptq_qweight(qT: np.ndarray, bits: int) -> np.ndarray:
    """qT [K, N] unsigned -> int32 [K*bits/32, N], AutoGPTQ's loop over rows."""
    k, n = qT.shape
    per = 32 // bits
    out = np.zeros((k // per, n), dtype=np.uint32)
    for row in range(k // per):
        for j in range(per):
            out[row] |= qT[row * per + j].astype(np.uint32) << np.uint32(bits * j)
    return out.view(np.int32)


def pack_cols(z: np.ndarray, bits: int, order: list[int] | None = None) -> np.ndarray:
    """[G, N] unsigned -> int32 [G, N*bits/32], packed along N (AWQ order if given)."""
    g, n = z.shape
    per = 32 // bits
    out = np.zeros((g, n // per), dtype=np.uint32)
    for col in range(n // per):
        for j in range(per):
            src = col * per + (order[j] if order else j)
            out[:, col] |= (z[:, src].astype(np.uint32) & np.uint32((1 << bits) - 1)) << np.uint32(bits * j)
    return out.view(np.int32)


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float16) -> Any:
    cfg = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    model: Any = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def made_once(factory: Any, sources: Mapping[str, Callable[[Path], Any]]) -> Callable[[str], tuple[Path, Any]]:
    """``name -> (directory, reference)``: each source of ``sources`` written once per test module
    (into ``factory``'s temp directories, the directory named ``name``), on first use."""
    made: dict[str, tuple[Path, Any]] = {}

    def get(name: str) -> tuple[Path, Any]:
        if name not in made:
            path = factory.mktemp("src") / name
            path.mkdir()
            made[name] = (path, sources[name](path))
        return made[name]

    return get


def ct_checkpoint(
    out: Path,
    fmt: str,
    weights: dict[str, Any],
    activations: dict[str, Any] | None = None,
    seed: int = 0,
    model: Any = None,
) -> None:
    """A tiny bf16 Llama (or ``model``) quantized by compressed-tensors' own lifecycle (what
    llmcompressor calls to save): ``weights`` (QuantizationArgs: ``tensor``, ``channel`` or ``group``
    strategy) on every Linear but ``lm_head``, min-max qparams, compressed as ``fmt`` and saved to ``out``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = tiny_llama(seed, torch.bfloat16) if model is None else model
    args = QuantizationArgs.model_validate(weights)
    act = None if activations is None else QuantizationArgs.model_validate(activations)
    qc = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args, input_activations=act)},
        ignore=["lm_head"],
        quantization_status=QuantizationStatus.INITIALIZED,
    )
    apply_quantization_config(model, qc)
    mods: list[Any] = list(model.modules())
    for mod in mods:
        if not hasattr(mod, "weight_scale"):
            continue
        w = mod.weight.detach().float()
        n, k = w.shape
        size = int(weights.get("group_size") or k)  # channel: one group spans K
        g = w.reshape(1, 1, n * k) if weights["strategy"] == "tensor" else w.reshape(n, k // size, size)
        s, z = calculate_qparams(g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0), args)
        mod.weight_scale.data = s.to(mod.weight_scale.dtype).reshape(mod.weight_scale.shape)
        if hasattr(mod, "weight_zero_point"):
            mod.weight_zero_point.data = z.reshape(mod.weight_zero_point.shape).to(mod.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))


def compile_to(src: Path, target: str, out: Path, *extra: str) -> Any:
    return run_cli("compile", str(src), "--target", target, "-o", str(out), "--quiet", *extra)


def logits(model: Any, ids: list[int] = IDS) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].double().numpy()


def llama_cpp_logits(path: Path, ids: list[int] = IDS) -> np.ndarray:
    """llama.cpp's logits for every position of ``ids``, from the artifact's ``model.gguf``."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path / "model.gguf"), logits_all=True, n_ctx=64, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def artifact_decodes(path: Path) -> dict[str, np.ndarray]:
    m = open_artifact(path).module
    return {name: decoded(m, op, t) for name, op, t in weights(m)}


def assert_decodes_equal_reference(path: Path, reference: Any) -> None:
    """Every weight of the artifact decodes bit for bit to the checkpoint's own decode."""
    got = artifact_decodes(path)
    assert got
    for name, values in got.items():
        want = reference.get_parameter(name).detach().float().numpy()
        assert np.array_equal(values.view(np.uint32), want.view(np.uint32)), name


def assert_equals_llama_quantize(ours: Path, f32: Path, ftype: str, tmp: Path) -> dict[str, Any]:
    """llama.cpp's own ``llama_model_quantize`` of our F32 artifact ``f32`` to ``ftype`` (a
    ``LLAMA_FTYPE_*`` name) gives exactly the tensors of our ``ours`` artifact: the same names, ggml
    types and bytes. Returns llama.cpp's tensors by name."""
    import ctypes

    import gguf
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.nthread = 1
    theirs = tmp / "theirs.gguf"
    quantize: Any = llama_cpp.llama_model_quantize  # its stub wants a typed pointer; byref is what it takes
    assert quantize(str(f32 / "model.gguf").encode(), str(theirs).encode(), ctypes.byref(params)) == 0
    a = {t.name: t for t in gguf.GGUFReader(str(ours / "model.gguf")).tensors}
    b = {t.name: t for t in gguf.GGUFReader(str(theirs)).tensors}
    assert sorted(a) == sorted(b)
    for name, t in b.items():
        assert a[name].tensor_type == t.tensor_type, name
        assert np.array_equal(np.asarray(a[name].data), np.asarray(t.data)), name
    return b

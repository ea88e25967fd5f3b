"""Act-order pre-quantized checkpoints as sources: GPTQ ``desc_act`` (and compressed-tensors
``actorder: "group"``) layers whose ``g_idx`` is a shuffled order of equal groups compile exactly where
the target holds a column permutation (triton; onnx by gathering the input, see
``test_onnx_act_order.py``) and are a measured conversion where it does not (compressed-tensors, gguf).

The GPTQ checkpoints come from an independent packer written here from the published layout: the
columns are quantized in act order (sorted by group), the codes stored in the original order with the
group of each column in ``g_idx``. The reference is the float model whose Linear weights are the
published decode ``scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])`` of the packer's own values."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prequant_packers import (
    IDS,
    compile_to,
    logits,
    made_once,
    pack_cols,
    pack_gptq_qweight,
    rel_l2,
    rtn_unsigned,
    tiny_llama,
)
from safetensors.torch import load_file, save_file

from qcompiler.artifact.reader import open_artifact
from qcompiler.ir.interpret import run_graph
from qcompiler.parity import decoded, weights
from qcompiler.quant.modules import QuantEmbedding, QuantLinear, tied_twin
from qcompiler.quant.rtn import AffineQuant

Q = "model.layers.0.self_attn.q_proj"
LINEARS = 14
"""Quantized Linears of the tiny Llama (7 per layer, 2 layers; lm_head stays dense)."""


def act_order(k: int, group: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ's act order for ``k`` columns: ``perm`` (the columns in the order they are quantized, as
    the Hessian's diagonal would sort them; here shuffled) and ``g_idx[perm[i]] = i // group``."""
    perm = rng.permutation(k)
    g_idx = np.empty(k, dtype=np.int64)
    g_idx[perm] = np.arange(k) // group
    return perm, g_idx


def finish_config(model: Any, out: Path, qc: dict[str, Any]) -> None:
    model.config.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update({"torch_dtype": "float16", "architectures": ["LlamaForCausalLM"], "quantization_config": qc})
    cfg.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(cfg))


def write_gptq_act_order(out: Path, kind: str, bits: int, group: int, sym: bool, seed: int = 0) -> Any:
    """A GPTQ (``gptq`` = v1, ``gptq_v2``) ``desc_act`` checkpoint of a tiny Llama; returns the float
    model whose Linear weights are the checkpoint's published decode (the reference)."""
    model = tiny_llama(seed)
    rng = np.random.default_rng(seed + 1)
    tensors = {name: p.detach().clone().contiguous() for name, p in model.state_dict().items()}
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name == "lm_head":
            continue
        w = mod.weight.detach().float().numpy()
        perm, g_idx = act_order(w.shape[1], group, rng)
        q_sorted, z, s = rtn_unsigned(w[:, perm], bits, group, sym)  # groups of consecutive sorted columns
        q = np.empty_like(q_sorted)
        q[:, perm] = q_sorted  # stored in the original column order
        del tensors[f"{name}.weight"]
        tensors[f"{name}.qweight"] = torch.from_numpy(pack_gptq_qweight(q.T.copy(), bits))
        tensors[f"{name}.qzeros"] = torch.from_numpy(pack_cols((z.T - 1 if kind == "gptq" else z.T).copy(), bits))
        tensors[f"{name}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        tensors[f"{name}.scales"] = torch.from_numpy(s.T.copy())
        dec = s.astype(np.float32)[:, g_idx] * (q - z[:, g_idx]).astype(np.float32)
        mod.weight.data = torch.from_numpy(dec)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": True}
    finish_config(model, out, {**qc, "checkpoint_format": kind})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return model.float()


def write_ct_act_order(out: Path, bits: int, group: int, seed: int = 0) -> Any:
    """A compressed-tensors ``pack-quantized`` asymmetric checkpoint in ``actorder: "group"`` form.

    compressed-tensors 0.20 can no longer write one (its ``QuantizationArgs`` refuses ``actorder:
    "group"`` and its compressor has no ``weight_g_idx``), so its compressor packs the act-ordered
    (sorted) columns, and its own ``unpack_from_int32``/``pack_to_int32`` put the codes back in the
    original column order, beside the ``weight_g_idx`` older versions wrote. Returns the reference
    model: ``(q - z[:, g_idx]) * s[:, g_idx]`` read back with compressed-tensors' unpacker."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = tiny_llama(seed, torch.bfloat16)
    args = QuantizationArgs.model_validate(
        {"num_bits": bits, "type": "int", "symmetric": False, "strategy": "group", "group_size": group}
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    qc = QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=["lm_head"], quantization_status=QuantizationStatus.INITIALIZED
    )
    apply_quantization_config(model, qc)
    rng = np.random.default_rng(seed + 1)
    orders: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, mod in list(model.named_modules()):
        if not hasattr(mod, "weight_scale"):
            continue
        w = mod.weight.detach()
        n, k = w.shape
        orders[name] = perm, _ = act_order(k, group, rng)
        mod.weight.data = w[:, torch.from_numpy(perm)].contiguous()  # the compressor sees act order
        g = mod.weight.detach().float().reshape(n, k // group, group)
        s, z = calculate_qparams(g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0), args)
        mod.weight_scale.data = s.to(mod.weight_scale.dtype).reshape(mod.weight_scale.shape)
        mod.weight_zero_point.data = z.reshape(mod.weight_scale.shape).to(mod.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    tensors = load_file(str(out / "model.safetensors"))
    reference = tiny_llama(seed, torch.bfloat16).float()
    for name, (perm, g_idx) in orders.items():
        n, k = reference.get_submodule(name).weight.shape
        q_sorted = unpack_from_int32(tensors[f"{name}.weight_packed"], bits, torch.Size([n, k]))
        q = torch.empty_like(q_sorted)
        q[:, torch.from_numpy(perm)] = q_sorted
        tensors[f"{name}.weight_packed"] = pack_to_int32(q, bits)
        tensors[f"{name}.weight_g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        s = tensors[f"{name}.weight_scale"].float()
        zp = tensors[f"{name}.weight_zero_point"]
        z = unpack_from_int32(zp, bits, torch.Size([n, s.shape[1]]), packed_dim=0).to(torch.int64)
        cols = torch.from_numpy(g_idx)
        reference.get_submodule(name).weight.data = (q.to(torch.int64) - z[:, cols]).float() * s[:, cols]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (out / "config.json").write_text(json.dumps(cfg))
    return reference


SOURCES: dict[str, Callable[[Path], Any]] = {
    "gptq-v1-asym-4b-g32-desc-act": lambda p: write_gptq_act_order(p, "gptq", 4, 32, False),
    "gptq-v2-sym-8b-g64-desc-act": lambda p: write_gptq_act_order(p, "gptq_v2", 8, 64, True),
    "ct-pack-asym-4b-g32-actorder-group": lambda p: write_ct_act_order(p, 4, 32),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    return made_once(tmp_path_factory, SOURCES)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_triton_holds_act_order_as_a_permutation_exactly(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, name: str
) -> None:
    """No conversion: every weight keeps its codes with an explicit permutation, decodes bit for bit
    to the checkpoint's published decode, and the artifact's graph gives the reference's logits."""
    src, reference = source(name)
    out = tmp_path / "triton"
    r = compile_to(src, "triton", out)
    assert r.code == 0, r.err
    assert json.loads((out / "manifest.json").read_text())["conversions"] == []
    module = open_artifact(out).module
    found = weights(module)
    assert len(found) == LINEARS
    for weight, op, t in found:
        assert t.perm is not None, weight
        want = reference.get_parameter(weight).detach().float().numpy()
        assert np.array_equal(decoded(module, op, t).view(np.uint32), want.view(np.uint32)), weight
    got = run_graph(module, [torch.tensor([IDS])])[0][0].double().numpy()
    assert rel_l2(got, logits(reference)) < 1e-4


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_onnx_holds_act_order_with_only_the_f32_scale_widening(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, name: str
) -> None:
    """The permutation is no conversion for onnx (its ``q.linear`` gathers the input); the scales are
    still widened to onnxruntime's f32, exactly, so ``--allow-conversion`` is still asked for."""
    src, reference = source(name)
    out = tmp_path / "onnx"
    r = compile_to(src, "onnx", out, "--allow-conversion")
    assert r.code == 0, r.err
    records = json.loads((out / "manifest.json").read_text())["conversions"]
    assert {c["kind"] for c in records} == {"scale-dtype"}, records
    assert all("permutation" not in c["reason"] and c["max_abs_err"] == 0.0 for c in records), records
    module = open_artifact(out).module
    for weight, op, t in weights(module):
        assert t.perm is not None, weight
        want = reference.get_parameter(weight).detach().float().numpy()
        assert np.array_equal(decoded(module, op, t).view(np.uint32), want.view(np.uint32)), weight


@pytest.mark.parametrize("target", ["safetensors", "gguf"])
def test_targets_without_a_permutation_refuse_it_then_measure_the_conversion(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, target: str
) -> None:
    src, _ = source("gptq-v1-asym-4b-g32-desc-act")
    r = compile_to(src, target, tmp_path / "no")
    assert r.code == 1, r.err
    assert "permutation" in r.err, r.err
    assert "--allow-conversion" in r.err, r.err
    assert not (tmp_path / "no").exists()
    r = compile_to(src, target, tmp_path / "yes", "--allow-conversion")
    assert r.code == 0, r.err
    records = json.loads((tmp_path / "yes" / "manifest.json").read_text())["conversions"]
    assert len({c["tensor"] for c in records}) == LINEARS
    for c in records:
        assert "permutation" in c["reason"], c
        assert isinstance(c["max_abs_err"], float), c
        assert isinstance(c["rel_l2"], float), c


def test_a_compressed_tensors_act_order_checkpoint_is_refused_by_its_own_format(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path
) -> None:
    """compressed-tensors >= 0.20 has no ``g_idx``: writing the act-order source back is a conversion."""
    src, _ = source("ct-pack-asym-4b-g32-actorder-group")
    r = compile_to(src, "safetensors", tmp_path / "no")
    assert r.code == 1, r.err
    assert "act-order permutation" in r.err, r.err


def uneven(t: dict[str, torch.Tensor]) -> None:
    g_idx = t[f"{Q}.g_idx"]
    g_idx[int(torch.nonzero(g_idx == 1)[0])] = 0  # group 0 now has 33 columns, group 1 has 31


@pytest.mark.parametrize("target", ["triton", "safetensors"])
def test_a_g_idx_of_uneven_groups_is_refused_naming_the_tensor(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, target: str
) -> None:
    """Only a permutation of whole groups can be stored; anything else is a typed error, not a
    conversion, whatever the target."""
    src, _ = source("gptq-v1-asym-4b-g32-desc-act")
    dst = tmp_path / "uneven"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    uneven(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    r = compile_to(dst, target, tmp_path / "o", "--allow-conversion")
    assert r.code == 1, r.err
    assert "Traceback" not in r.err
    for word in (f"{Q}.g_idx", "uneven groups", "33 columns"):
        assert word in r.err, r.err
    assert not (tmp_path / "o").exists()


def quant_with_g_idx(seed: int = 0) -> tuple[AffineQuant, np.ndarray]:
    rng = np.random.default_rng(seed)
    _, g_idx = act_order(64, 16, rng)
    codes = torch.from_numpy(rng.integers(-8, 8, size=(8, 64)).astype(np.int8))
    scale = torch.from_numpy((rng.random((8, 4)) * 0.1 + 0.01).astype(np.float32))
    zero = torch.from_numpy(rng.integers(-2, 3, size=(8, 4)).astype(np.int8))
    q = AffineQuant(codes, scale, zero, -8, 7, 16, torch.from_numpy(g_idx.astype(np.int32)))
    want = (codes.numpy().astype(np.float32) - zero.numpy()[:, g_idx]) * scale.numpy()[:, g_idx]
    return q, want.astype(np.float32)


def test_a_quantized_linear_decodes_each_column_with_its_groups_qparams() -> None:
    q, want = quant_with_g_idx()
    assert np.array_equal(q.dequantize().numpy().view(np.uint32), want.view(np.uint32))
    lin = QuantLinear(q, None, torch.float32, {"kind": "test"})
    assert np.array_equal(lin.dequantized_weight().numpy().view(np.uint32), want.view(np.uint32))
    emb = QuantEmbedding(q, None, torch.float32, {"kind": "test"})
    twin = tied_twin(emb, torch.nn.Linear(64, 8, bias=False))
    assert twin.get_buffer("g_idx") is emb.get_buffer("g_idx")  # the table's own tensors
    assert np.array_equal(twin(torch.eye(64)).T.numpy().view(np.uint32), want.view(np.uint32))

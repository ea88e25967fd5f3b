"""Act-order GPTQ checkpoints (``desc_act``, a shuffled ``g_idx``) on the ONNX targets: held exactly.

The weight keeps its grouped codes and its permutation ``perm`` (stored column ``j`` is original column
``perm[j]``); each ``q.linear`` reads its input gathered, ``Gather(x, perm, axis=-1)``, into
``MatMulNBits`` (``onnx-nbits``) or ``DequantizeLinear -> MatMul`` (``onnx-qdq``). The only conversion
is onnxruntime's f32 scales (``scale-dtype``, exact from f16). The checkpoints come from an independent
packer written here from the published layout (as in ``test_prequant_act_order.py``): columns quantized
in act order, codes stored in the original order with each column's group in ``g_idx``. The reference
is the float model whose Linear weights are the published decode
``scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
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
from safetensors.torch import save_file

from qcompiler.artifact.reader import open_artifact
from qcompiler.backends.onnx.dispatch import session_options
from qcompiler.backends.onnx.feeds import prefill_feed, teacher_forced
from qcompiler.parity import decoded, weights
from qcompiler.testing import CliResult, rehash, run_cli

LINEARS = 14
"""Quantized Linears of the tiny Llama (7 per layer, 2 layers; lm_head stays dense)."""
TARGETS = ["onnx-nbits", "onnx-qdq"]


def act_order(k: int, group: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ's act order for ``k`` columns: ``perm`` (the columns in the order they are quantized;
    here shuffled) and ``g_idx[perm[i]] = i // group``."""
    perm = rng.permutation(k)
    g_idx = np.empty(k, dtype=np.int64)
    g_idx[perm] = np.arange(k) // group
    return perm, g_idx


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
        mod.weight.data = torch.from_numpy(s.astype(np.float32)[:, g_idx] * (q - z[:, g_idx]).astype(np.float32))
    model.config.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": True}
    cfg.update({"torch_dtype": "float16", "architectures": ["LlamaForCausalLM"]})
    cfg.update({"quantization_config": {**qc, "checkpoint_format": kind}})
    cfg.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return model.float()


SOURCES: dict[str, Callable[[Path], Any]] = {
    "gptq-v1-asym-4b-g32-desc-act": lambda p: write_gptq_act_order(p, "gptq", 4, 32, False),
    "gptq-v2-sym-8b-g64-desc-act": lambda p: write_gptq_act_order(p, "gptq_v2", 8, 64, True),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    return made_once(tmp_path_factory, SOURCES)


def ort_session(path: Path) -> Any:
    """A CPU session at accuracy level 1 (fp32), the artifact's: a QDQ model's ``DequantizeLinear ->
    MatMul`` is fused to ``MatMulNBits`` at the session's ``qdq_matmulnbits_accuracy_level``, which
    is 4 (int8 activations, rel-L2 near 8e-3 here) unless set; an ``onnx-nbits`` model is the same
    either way."""
    import onnxruntime as ort

    return ort.InferenceSession(str(path), sess_options=session_options(1), providers=["CPUExecutionProvider"])


def ort_logits(out: Path) -> np.ndarray:
    """``model.onnx``'s logits for ``IDS``, one prefill on an empty cache."""
    sess = ort_session(out / "model.onnx")
    return np.asarray(sess.run(None, prefill_feed(sess, np.array([IDS], dtype=np.int64)))[0])[0].astype(np.float64)


def ort_logits_with_past(out: Path, prefill: int) -> np.ndarray:
    """``model.onnx``'s logits for ``IDS``: ``prefill`` tokens on an empty cache, then one at a time."""
    sess = ort_session(out / "model.onnx")
    return teacher_forced(sess, np.array([IDS], dtype=np.int64), prefill)[0].astype(np.float64)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_onnx_holds_act_order_by_gathering_the_input(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path, name: str, target: str
) -> None:
    """Only the exact f16 -> f32 scale widening is a conversion; every weight keeps its permutation and
    decodes bit for bit to the published decode; onnxruntime's logits (the model and its KV-cache
    decoding through its cache) are the reference's; ``verify`` passes, dispatch proof included."""
    src, reference = source(name)
    out = tmp_path / target
    r = compile_to(src, target, out, "--allow-conversion")
    assert r.code == 0, r.err
    records = json.loads((out / "manifest.json").read_text())["conversions"]
    assert {c["kind"] for c in records} == {"scale-dtype"}, records
    assert not [c for c in records if "permutation" in c["reason"]], records
    assert all(c["max_abs_err"] == 0.0 for c in records), records
    module = open_artifact(out).module
    found = weights(module)
    assert len(found) == LINEARS
    for weight, op, t in found:
        assert t.perm is not None, weight
        want = reference.get_parameter(weight).detach().float().numpy()
        assert np.array_equal(decoded(module, op, t).view(np.uint32), want.view(np.uint32)), weight
    want = logits(reference)
    got, got_past = ort_logits(out), ort_logits_with_past(out, 16)
    print(f"{name} {target}: rel-L2 {rel_l2(got, want):.2e}, with past {rel_l2(got_past, want):.2e}")
    assert rel_l2(got, want) < 1e-4
    assert rel_l2(got_past, want) < 1e-4
    r = run_cli("verify", str(out))
    assert r.code == 0, r.out + r.err


def perm_gathers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "Gather" and n.input[1].endswith(".perm")]


def test_each_quantized_linear_gathers_its_input_with_its_own_perm(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path
) -> None:
    """One ``Gather(x, W.perm, axis=-1)`` per linear, feeding its ``MatMulNBits``; ``W.perm`` is the
    IR's int32 permutation, inline below 1 KiB, in ``model.onnx.data`` from 1 KiB (K = 256: down_proj)."""
    src, _ = source("gptq-v1-asym-4b-g32-desc-act")
    out = tmp_path / "nbits"
    assert compile_to(src, "onnx-nbits", out, "--allow-conversion", "--onnx-no-cache-graph").code == 0
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    gathers = perm_gathers(model)
    assert len(gathers) == LINEARS
    readers = {i: n for n in model.graph.node for i in n.input}
    inits = {t.name: t for t in model.graph.initializer}
    for g in gathers:
        assert readers[g.output[0]].op_type == "MatMulNBits", g.name
        assert [a.i for a in g.attribute if a.name == "axis"] == [-1], g.name
        perm = inits[g.input[1]]
        assert perm.data_type == onnx.TensorProto.INT32, perm.name
        assert len(perm.external_data) == (perm.dims[0] == 256) * 3, perm.name
    assert len(perm_gathers(onnx.load(str(out / "model_no_cache.onnx"), load_external_data=False))) == LINEARS


def tampered(src: Path, tmp_path: Path, edit: Callable[[onnx.ModelProto], None]) -> CliResult:
    """``verify`` of the onnx-nbits artifact of ``src`` after ``edit`` of ``model.onnx``, the manifest
    re-hashed (so only the reader's own gates can notice)."""
    out = tmp_path / "nbits"
    assert compile_to(src, "onnx-nbits", out, "--allow-conversion").code == 0
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    edit(model)
    (out / "model.onnx").write_bytes(model.SerializeToString())
    rehash(out)
    return run_cli("verify", str(out))


def refused(r: CliResult, *words: str) -> None:
    assert r.code == 1, r.out + r.err
    text = " ".join((r.out + r.err).split())
    assert "Traceback" not in text
    for word in words:
        assert word in text, text


def test_a_perm_initializer_of_the_wrong_length_is_refused_by_the_nodes_gate(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path
) -> None:
    def shorten(model: onnx.ModelProto) -> None:
        perm = next(t for t in model.graph.initializer if t.name == perm_gathers(model)[0].input[1])
        del perm.dims[:]
        perm.dims.append(64)
        perm.raw_data = perm.raw_data[: 64 * 4]

    src, _ = source("gptq-v1-asym-4b-g32-desc-act")
    refused(tampered(src, tmp_path, shorten), "act-order perm holds K indices", "[128] int32 | int64", "[64] int32")


def test_a_linear_gathering_with_another_weights_perm_is_refused_by_the_binding_gate(
    source: Callable[[str], tuple[Path, Any]], tmp_path: Path
) -> None:
    """Every initializer intact (the graph gate passes), but q_proj's input is gathered with k_proj's
    permutation (same length): the node differs from what graph.qir lowers to."""
    swapped: list[str] = []

    def rewire(model: onnx.ModelProto) -> None:
        q, k = perm_gathers(model)[:2]
        q.input[1] = k.input[1]
        swapped.append(q.name)

    src, _ = source("gptq-v1-asym-4b-g32-desc-act")
    r = tampered(src, tmp_path, rewire)
    refused(r, "differs from what graph.qir lowers to", "model.onnx: graph.node", f"'{swapped[0]}'.input")

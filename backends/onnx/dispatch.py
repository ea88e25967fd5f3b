"""Dispatch proof: what onnxruntime actually runs after its graph optimisations.

The model is optimised by onnxruntime (``ORT_ENABLE_ALL``, CPU) and the optimised model is saved and
read back. Every quantized linear of ``graph.qir`` must run as ``com.microsoft.MatMulNBits``, and no
``DequantizeLinear -> MatMul`` pair may remain: such a pair is a dense weight rebuilt on every run, a
silent fallback. It counts the ``com.microsoft.GroupQueryAttention`` nodes too: the decoder graph of
an artifact compiled with ``--onnx-attention gqa`` (``provenance.onnx_attention``) must keep one per
causal attention layer of ``graph.qir`` (``attention_layers``), or the proof fails. A QDQ model's fused
nodes take their ``accuracy_level`` from the session option ``session.qdq_matmulnbits_accuracy_level``,
set here to the artifact's recorded level.

A model onnxruntime refuses to load or optimise (one of ``ORT_ERRORS``) is a failed proof, reported
with ``ok: false`` and an ``error`` naming the file (an ``ArtifactError``'s text), not a crash.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import onnx

from qcompiler.artifact.reader import ArtifactError
from qcompiler.artifact.request import OpenedArtifact
from qcompiler.backends.onnx import gqa
from qcompiler.backends.onnx.kv_cache import DECOMPOSED
from qcompiler.backends.onnx.weights import MODEL_FILE, NO_CACHE_FILE
from qcompiler.ir.ops.attention import Sdpa


def session_options(accuracy_level: int, optimized: Path | None = None) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy_level))
    so.log_severity_level = 3
    if optimized is not None:
        so.optimized_model_filepath = str(optimized)
    return so


ORT_ERRORS = (
    "Fail",
    "InvalidArgument",
    "NoSuchFile",
    "NoModel",
    "EngineError",
    "RuntimeException",
    "InvalidProtobuf",
    "NotImplemented",
    "InvalidGraph",
    "EPFail",
)
"""onnxruntime's exception types (``onnxruntime.capi.onnxruntime_pybind11_state``) that say a model
cannot be loaded or optimised: a property of the input."""


def ort_errors() -> tuple[type[BaseException], ...]:
    import importlib

    state = importlib.import_module("onnxruntime.capi.onnxruntime_pybind11_state")
    found = (getattr(state, name, None) for name in ORT_ERRORS)
    return (RuntimeError, *(e for e in found if isinstance(e, type) and issubclass(e, BaseException)))


def accuracy_of(opened: OpenedArtifact) -> int:
    prov = (opened.manifest or {}).get("provenance", {})
    level = prov.get("accuracy_level", 1) if isinstance(prov, dict) else 1
    return level if isinstance(level, int) and not isinstance(level, bool) else 1


def attention_of(opened: OpenedArtifact) -> str:
    prov = (opened.manifest or {}).get("provenance", {})
    form = prov.get("onnx_attention", DECOMPOSED) if isinstance(prov, dict) else DECOMPOSED
    return form if isinstance(form, str) else DECOMPOSED


def dispatch_report(opened: OpenedArtifact) -> dict[str, Any]:
    """The dispatch proof for ``model.onnx`` and, when present, ``model_no_cache.onnx``."""
    quantized = sum(1 for op in opened.module.ops() if op.name == "q.linear")
    report = optimized_report(opened.path / MODEL_FILE, accuracy_of(opened), quantized)
    layers = sum(1 for op in opened.module.ops() if isinstance(op, Sdpa) and op.causal)
    if attention_of(opened) == gqa.GQA and "error" not in report:
        report["attention_layers"] = layers
        report["ok"] = report["ok"] and report["group_query_attention"] >= layers
    no_cache = opened.path / NO_CACHE_FILE
    if no_cache.is_file():
        report["no_cache"] = optimized_report(no_cache, accuracy_of(opened), quantized)
        report["ok"] = report["ok"] and report["no_cache"]["ok"]
    return report


def optimized_report(path: Path, accuracy: int, quantized: int) -> dict[str, Any]:
    """What onnxruntime runs for the model at ``path`` once optimised (see the module docstring)."""
    import onnxruntime as ort

    runtime = f"onnxruntime {ort.__version__} CPU, ORT_ENABLE_ALL"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "optimized.onnx"
        try:
            ort.InferenceSession(
                str(path), sess_options=session_options(accuracy, out), providers=["CPUExecutionProvider"]
            )
        except ort_errors() as e:
            text = (str(e).splitlines() or [type(e).__name__])[0][:300]
            error = ArtifactError(f"onnxruntime cannot load it ({type(e).__name__}): {text}", file=path.name)
            return {"runtime": runtime, "quantized_linears": quantized, "ok": False, "error": str(error)}
        model = onnx.load(str(out), load_external_data=False)
    nodes = list(model.graph.node)
    made_by = {o: n for n in nodes for o in n.output}
    nbits = [n for n in nodes if n.op_type == "MatMulNBits"]
    left = [
        n.name
        for n in nodes
        if n.op_type in ("MatMul", "Gemm", "FusedMatMul")
        and any(made_by.get(i) is not None and made_by[i].op_type == "DequantizeLinear" for i in n.input)
    ]
    levels = sorted({a.i for n in nbits for a in n.attribute if a.name == "accuracy_level"})
    ok = len(nbits) >= quantized and not left
    return {
        "runtime": runtime,
        "quantized_linears": quantized,
        "matmulnbits": len(nbits),
        "accuracy_levels": levels,
        "dequantize_matmul_left": left,
        "group_query_attention": sum(1 for n in nodes if n.op_type == gqa.OP and n.domain == gqa.DOMAIN),
        "ok": ok,
    }

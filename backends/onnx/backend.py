"""The ``onnx`` targets for onnxruntime: ``onnx-qdq`` (blocked ``DequantizeLinear -> MatMul``, which
onnxruntime fuses) and ``onnx-nbits`` (``com.microsoft.MatMulNBits`` directly); ``onnx`` is ``onnx-nbits``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from qcompiler.artifact.request import ArtifactRequest, OpenedArtifact
from qcompiler.backends.base import Backend, ContainerTensor, LayoutPlan
from qcompiler.backends.onnx import plan as planning
from qcompiler.ir.core import Module
from qcompiler.ir.types import QuantType


class OnnxBackend(Backend):
    name: ClassVar[str] = "onnx-nbits"
    container: ClassVar[str] = "onnx/ir10-opset21"
    shardable: ClassVar[bool] = False
    form: ClassVar[str] = "nbits"
    options: ClassVar[frozenset[str]] = frozenset({"accuracy_level", "no_cache_graph", "attention"})

    def plan(self, name: str, t: QuantType, prefer: str = "", model_dtype: str = "") -> LayoutPlan:
        return planning.plan(name, t, self.form)

    def container_tensors(self, m: Module) -> list[ContainerTensor]:
        return planning.container_tensors(m)

    def shard_file_names(self, count: int) -> list[str]:
        return ["model.onnx"]

    def emit(self, m: Module, request: ArtifactRequest) -> Path:
        from qcompiler.backends.onnx.emit import emit

        return emit(m, request, self.form)

    def versions(self, opened: OpenedArtifact) -> dict[str, Any]:
        from qcompiler.backends.onnx.emit import OPSET

        return {"onnx_opset": OPSET, "onnx_form": self.form}

    def provenance(self, opened: OpenedArtifact) -> dict[str, Any]:
        from qcompiler.backends.onnx.package import provenance

        return {"package": provenance(opened.module, opened.config or None)}

    def open(self, path: Path, manifest: dict[str, Any] | None) -> OpenedArtifact:
        from qcompiler.backends.onnx.read import open_onnx_dir

        return open_onnx_dir(path, manifest, self.form)

    def runtime_report(self, opened: OpenedArtifact) -> dict[str, Any] | None:
        from qcompiler.backends.onnx.dispatch import dispatch_report

        return dispatch_report(opened)


class OnnxQdqBackend(OnnxBackend):
    name: ClassVar[str] = "onnx-qdq"
    form: ClassVar[str] = "qdq"

"""The ``triton`` target: weights in the kernels' own layout plus generated fused low-bit Triton
kernels, which ``qcompiler.load(device="cuda")`` registers and dispatches to."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from qcompiler.artifact.request import ArtifactRequest, OpenedArtifact
from qcompiler.backends.base import Backend, ContainerTensor, LayoutPlan
from qcompiler.backends.triton import plan as planning
from qcompiler.ir.core import Module
from qcompiler.ir.types import QuantType


class TritonBackend(Backend):
    name: ClassVar[str] = "triton"
    container: ClassVar[str] = "safetensors/1+triton-kernels"
    shardable: ClassVar[bool] = False
    descriptive_versions: ClassVar[tuple[str, ...]] = ("triton",)
    """The Triton that compiled the AOT evidence (bound with that evidence by graph.qir's record)."""

    def plan(self, name: str, t: QuantType, prefer: str = "", model_dtype: str = "") -> LayoutPlan:
        return planning.plan(name, t)

    def container_tensors(self, m: Module) -> list[ContainerTensor]:
        return planning.container_tensors(m)

    def shard_file_names(self, count: int) -> list[str]:
        return [planning.MODEL_FILE]

    def emit(self, m: Module, request: ArtifactRequest) -> Path:
        from qcompiler.backends.triton.emit import emit

        return emit(m, request)

    def versions(self, opened: OpenedArtifact) -> dict[str, Any]:
        from qcompiler.artifact.reader import read_json
        from qcompiler.backends.triton.codegen import CODEGEN_VERSION
        from qcompiler.backends.triton.runtime import MIN_CAPABILITY

        index = read_json(opened.path, planning.INDEX_FILE)  # checked by the kernels gate already
        return {
            "required_kernels": [e["id"] for e in index["kernels"]],
            "codegen": f"qcompiler-triton/v{CODEGEN_VERSION}",
            "min_capability": MIN_CAPABILITY,
        }

    def open(self, path: Path, manifest: dict[str, Any] | None) -> OpenedArtifact:
        from qcompiler.backends.triton.read import open_triton

        return open_triton(path, manifest)

    def runtime_kernels(self, opened: OpenedArtifact) -> list[Any]:
        from qcompiler.backends.triton.kinds import kind_of

        return [s for key in planning.module_kernels(opened.module) for s in kind_of(key).specs(key)]

    def runtime_report(self, opened: OpenedArtifact) -> dict[str, Any] | None:
        from qcompiler.backends.triton.dispatch import report

        return report(opened)

"""The ``gguf`` target: a llama.cpp model file (plus manifest and graph) for llama and BERT models."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from qcompiler.artifact.request import ArtifactRequest, OpenedArtifact
from qcompiler.backends.base import Backend, ContainerTensor, LayoutPlan
from qcompiler.backends.gguf import plan as planning
from qcompiler.errors import UsageError
from qcompiler.ir.core import Module
from qcompiler.ir.types import QuantType


class GgufBackend(Backend):
    name: ClassVar[str] = "gguf"
    container: ClassVar[str] = "gguf/3"

    shardable: ClassVar[bool] = False
    scales: ClassVar[str] = "f16"
    """ggml blocks hold f16 scales: ``--scheme w4-g32`` computes its codes against f16 scales and is
    exact Q4_0 (``w8-g32``: Q8_0), not a conversion."""

    def plan(self, name: str, t: QuantType, prefer: str = "", model_dtype: str = "") -> LayoutPlan:
        return planning.plan(name, t, prefer)

    def container_tensors(self, m: Module) -> list[ContainerTensor]:
        from qcompiler.backends.gguf.archs import ARCHS

        return planning.container_tensors(m, ARCHS.get(str(m.attrs.get("gguf_arch", "llama"))))

    def shard_file_names(self, count: int) -> list[str]:
        return [planning.GGUF_FILE]

    def emit(self, m: Module, request: ArtifactRequest) -> Path:
        from qcompiler.backends.gguf.emit import emit

        return emit(m, request)

    def check_source_config(self, config: dict[str, Any], scheme: str | None = None) -> None:
        from qcompiler.backends.gguf.archs import refusal

        if why := refusal(config):
            raise UsageError(why)

    def versions(self, opened: OpenedArtifact) -> dict[str, Any]:
        from qcompiler.backends.gguf.blobs import opened as gguf_file

        arch = gguf_file(opened.path, planning.GGUF_FILE).metadata["general.architecture"][1]
        return {"gguf_architecture": arch}

    def open(self, path: Path, manifest: dict[str, Any] | None) -> OpenedArtifact:
        from qcompiler.backends.gguf.read import open_gguf_dir

        return open_gguf_dir(path, manifest)

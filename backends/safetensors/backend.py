"""The ``safetensors`` target: compressed-tensors ``pack-quantized`` checkpoints for transformers and vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from qcompiler.artifact.request import ArtifactRequest, OpenedArtifact
from qcompiler.backends.base import Backend, ContainerTensor, LayoutPlan
from qcompiler.backends.safetensors import plan as planning
from qcompiler.errors import UsageError
from qcompiler.ir.core import Module
from qcompiler.ir.types import QuantType


class SafetensorsBackend(Backend):
    name: ClassVar[str] = "safetensors"
    scales: ClassVar[str] = "source"
    """compressed-tensors keeps scales in the model dtype (what llmcompressor writes)."""
    container: ClassVar[str] = "safetensors/1"

    def check_source_config(self, config: dict[str, Any], scheme: str | None = None) -> None:
        from qcompiler.backends.safetensors.ct_config import conv1d_refusal

        if scheme and (why := conv1d_refusal(config, scheme)):
            raise UsageError(why)

    def plan(self, name: str, t: QuantType, prefer: str = "", model_dtype: str = "") -> LayoutPlan:
        return planning.plan(name, t, model_dtype)

    def container_tensors(self, m: Module) -> list[ContainerTensor]:
        return planning.container_tensors(m)

    def shard_file_names(self, count: int) -> list[str]:
        return planning.shard_file_names(count)

    def emit(self, m: Module, request: ArtifactRequest) -> Path:
        from qcompiler.backends.safetensors.emit import emit

        return emit(m, request)

    def versions(self, opened: OpenedArtifact) -> dict[str, Any]:
        from qcompiler.backends.safetensors.emit import checkpoint_format

        return {"checkpoint_format": checkpoint_format(opened.config)}

    def provenance(self, opened: OpenedArtifact) -> dict[str, Any]:
        from qcompiler.artifact.manifest import canonical_sha256

        return {"quantization_config_sha256": canonical_sha256(opened.config.get("quantization_config"))}

    def open(self, path: Path, manifest: dict[str, Any] | None) -> OpenedArtifact:
        from qcompiler.backends.safetensors.read import open_safetensors

        return open_safetensors(path, manifest)

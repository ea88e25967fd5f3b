"""The backend contract, shared by ``place-shards``, ``pack-layouts`` and ``emit-container``.

A backend answers three questions about a module, then writes it:

1. ``plan(name, t)``: how is this quantized weight stored? Exactly, in a registered layout (the
   pass proves ``unpack(pack(Q)) == Q``), or only through a *conversion* (codes, groups, qparams or
   clipping would change), which ``pack-layouts`` refuses unless ``allow-conversion``.
2. ``container_tensors(m)``: which tensors the container will hold, with their exact byte sizes, so
   ``place-shards`` can cut files before anything is packed.
3. ``emit(m, request)``: write the artifact transactionally and reopen it through ``open``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from qcompiler.ir.types import PackSpec, QuantType

if TYPE_CHECKING:
    from qcompiler.artifact.request import ArtifactRequest, OpenedArtifact
    from qcompiler.ir.core import Module


@dataclass(frozen=True)
class LayoutPlan:
    """How a target stores one quantized weight.

    ``exact``: repacked into ``pack`` (codes, groups and qparams unchanged). ``conversion``: the
    target cannot hold the weight as it is; ``convert`` names the conversion (``dense``: store the
    decoded weight in its expressed dtype; ``scale-dtype``: round the scales to the expressed dtype)
    and ``reason`` says what the target lacks. ``refine``: the target holds the weight once its
    descriptor is written another way that keeps the codes and every decoded value
    (``passes/refine.py``: ``regroup``, ``affine-min``); applied without ``allow-conversion``.
    """

    kind: Literal["exact", "conversion", "refine"]
    pack: PackSpec | None = None
    convert: str = ""
    reason: str = ""
    to: str = ""
    """``scale-dtype``: the dtype scales are rounded to (default: the expressed dtype); ``regroup``:
    the group size."""


@dataclass(frozen=True)
class ContainerTensor:
    """One tensor the container will hold: its container name, IR dtype name, shape and bytes;
    ``owners`` are the IR tensor-table entries it is made from; ``file`` is ``model`` (checkpoint
    shards) or ``graph`` (graph-only constants)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    owners: tuple[str, ...]
    file: Literal["model", "graph"] = "model"


def dense_plan(reason: str) -> LayoutPlan:
    """The ``dense`` conversion, for a weight the target cannot hold because of ``reason``."""
    return LayoutPlan("conversion", convert="dense", reason=reason)


def refused(checks: Sequence[tuple[bool, str]]) -> LayoutPlan | None:
    """``dense_plan`` for the first check that fails, ``None`` when all hold."""
    return next((dense_plan(reason) for ok, reason in checks if not ok), None)


class Backend(ABC):
    """Base class of every backend (see the module docstring)."""

    name: ClassVar[str] = ""
    container: ClassVar[str] = ""
    """Container format and version, e.g. ``safetensors/1``."""

    shardable: ClassVar[bool] = True
    """Whether the container can be cut into several files (``--max-shard-size``)."""
    options: ClassVar[frozenset[str]] = frozenset()
    """The ``emit-container`` options this target reads (``accuracy_level``); any other option set
    away from its default is refused before anything is written."""
    scales: ClassVar[str] = "f32"
    """The dtype ``--scheme`` stores scales in (``quant.modules.scale_dtype_for``): ``source`` (a bf16/fp16
    model's own, where the container holds it exactly), ``f16`` (always: ggml) or ``f32`` (what the
    target's kernels read)."""

    @abstractmethod
    def plan(self, name: str, t: QuantType, prefer: str = "", model_dtype: str = "") -> LayoutPlan:
        """How ``t`` is stored. ``prefer`` names the source's own storage format (``TQ1_0``), which a
        target honours when it holds the weight exactly in it (``ir.module_attrs.source_formats``);
        ``model_dtype`` is the dtype the source's config declares (``bf16``; empty when none)."""

    @abstractmethod
    def container_tensors(self, m: Module) -> list[ContainerTensor]: ...

    @abstractmethod
    def shard_file_names(self, count: int) -> list[str]: ...

    @abstractmethod
    def emit(self, m: Module, request: ArtifactRequest) -> Path: ...

    @abstractmethod
    def open(self, path: Path, manifest: dict[str, Any] | None) -> OpenedArtifact: ...

    def check_source_config(self, config: dict[str, Any], scheme: str | None = None) -> None:
        """Refuse (``UsageError``) a source whose transformers config this target cannot write, before
        the compile captures it (an HF directory's config.json; a factory's is checked at emit);
        ``scheme``: the ``--scheme`` the compile quantizes it with, if any."""
        return None

    descriptive_versions: ClassVar[tuple[str, ...]] = ("tested_runtime",)
    """``versions`` keys that only describe (the peers it was tested with); every other key is checked."""

    def versions(self, opened: OpenedArtifact) -> dict[str, Any]:
        """The target's own ``versions`` keys, as this backend writes them for the opened artifact: the
        reader requires the manifest to say exactly this (``qcompiler/artifact/derived.py``)."""
        return {}

    def provenance(self, opened: OpenedArtifact) -> dict[str, Any]:
        """``provenance`` keys that restate the artifact's files, recomputed from the opened artifact:
        the reader requires the manifest to say exactly this."""
        return {}

    def runtime_kernels(self, opened: OpenedArtifact) -> list[Any]:
        """Kernels the artifact brings (registered into the runtime's registry when it is loaded)."""
        return []

    def runtime_report(self, opened: OpenedArtifact) -> dict[str, Any] | None:
        """What the target's runtime does with the artifact (``verify`` reports it; ``ok`` false fails)."""
        return None

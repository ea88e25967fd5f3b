"""What ``emit-container`` needs besides the module, and what a reopened artifact gives back.

``SourceInfo`` is gathered by the frontend (``capture_source``): the transformers config, tokenizer
files carried over byte for byte, and hashes of the source. ``ArtifactRequest`` travels in the
``PassContext`` to ``emit-container``. ``OpenedArtifact`` is what the production reader returns
after every gate passed: the manifest, the final QIR module whose tensors resolve into the
container's own bytes, and an inventory of the container's tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qcompiler.ir.core import Module
from qcompiler.proofs import Proofs


@dataclass
class SourceInfo:
    """The source model's non-tensor parts and identity."""

    spec: str
    config: dict[str, Any] | None = None
    """The transformers config (config.json contents); ``None`` for a plain ``nn.Module``."""
    files: dict[str, bytes] = field(default_factory=dict[str, bytes])
    """Tokenizer and generation files carried over verbatim (name -> bytes)."""
    source_sha256: str = ""
    """sha256 of the source weights (files of a directory, or the float state dict of a factory)."""
    revision: str = ""
    metadata: dict[str, Any] = field(default_factory=dict[str, Any])
    """Format-specific metadata carried verbatim to a target of the same format (a GGUF source's
    tokenizer key-values under ``gguf``)."""


CONFIG_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
"""config.json ``dtype`` (``torch_dtype`` before transformers 5) -> IR dtype name."""


def model_dtype(info: SourceInfo | None) -> dict[str, str]:
    """``{"model_dtype": ...}`` for provenance when the source's config declares its dtype."""
    config = info.config if info is not None and info.config else {}
    name = CONFIG_DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or ""))
    return {"model_dtype": name} if name else {}


@dataclass
class ArtifactRequest:
    """Where and how ``emit-container`` writes the artifact."""

    out: Path
    source: SourceInfo | None = None
    effective: Mapping[str, torch.Tensor] = field(default_factory=dict[str, torch.Tensor])
    """Weight name -> the model's own dequantized weight (parity rung 2 compares the artifact to it)."""
    float_weights: Mapping[str, torch.Tensor] = field(default_factory=dict[str, torch.Tensor])
    """Weight name -> the float weight before quantization (rung 3's quantization error)."""
    pipeline: str = ""
    options: dict[str, str] = field(default_factory=dict[str, str])
    """Target options that do not change the IR (``accuracy_level`` for ONNX)."""
    fail_at: str | None = None
    """Inject a failure at a writer step (tests)."""
    force: bool = False
    """Replace an output path that is not an artifact (a file, a symlink, another directory): ``--force``."""
    jobs: int = 1
    """Threads for the parity evidence on the reopened artifact (``--jobs``); the evidence is the same for any count."""
    probe: Callable[[Module], dict[str, Any] | None] | None = None
    """The graph probe of the reopened module, when ``emit-container`` started it on the module it
    hands over (``evidence.ProbeAhead``): it runs while the files are written."""
    proofs: Proofs = field(default_factory=Proofs)
    """Per-weight facts the passes proved on the way (``qcompiler.proofs``): the evidence on the
    reopened artifact takes those proven on the same bytes instead of proving them again."""


@dataclass
class ContainerEntry:
    """One tensor inside the container, as the reader found it."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class OpenedArtifact:
    """An artifact that passed every gate of the production reader."""

    path: Path
    target: str
    manifest: dict[str, Any] | None
    module: Module
    entries: list[ContainerEntry]
    gates: list[str] = field(default_factory=list[str])
    """Names of the gates that ran and passed, in order."""
    config: dict[str, Any] = field(default_factory=dict[str, Any])
    files: set[str] = field(default_factory=set[str])
    """Every artifact file a gate read or bound; ``open_artifact`` refuses any other listed file
    (one the target's consumers would ignore is not part of the artifact)."""

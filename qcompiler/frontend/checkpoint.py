"""How the frontend reads an HF-style directory's weight files without naming the backend that owns
their format: the backend declares its reader in the ``CHECKPOINTS`` table of its package
(``qcompiler.plugins``), and the frontend calls it through ``CheckpointReader``. One format today,
``safetensors`` (``backends/safetensors/source.py``); the frontend sits below the backends, so it
reaches the reader through the registry, never by import.

    reader = checkpoint_reader()
    reader.shard_names(root)             # ["model-00001-of-00002.safetensors", ...]
    reader.checkpoint_inventory(root)    # tensor -> Declared(file, dtype, shape), every gate passed
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from qcompiler import plugins

if TYPE_CHECKING:
    from qcompiler.frontend.reading import SourceTensor

WEIGHTS = "safetensors"
"""The weight file format of the directories the frontend reads."""


class Declared(Protocol):
    """One tensor a checkpoint declares: its file, dtype (the format's name) and shape."""

    @property
    def file(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


class CheckpointReader(Protocol):
    """What a ``CHECKPOINTS`` provider offers (a module with these functions). Its errors are
    ``qcompiler.errors.FileError`` naming the file, tensor and field."""

    def shard_names(self, root: Path) -> list[str]:
        """The weight files of ``root``, in the order the stream reads them."""
        ...

    def checkpoint_inventory(self, root: Path) -> Mapping[str, Declared]:
        """Tensor name -> where it is declared, every header and the index checked."""
        ...

    def read_declared(self, root: Path, d: Declared, tensor: str) -> bytes:
        """One declared tensor's bytes (a tied alias's must equal its twin's)."""
        ...

    def shard_tensors(self, root: Path) -> dict[str, list[SourceTensor]]:
        """Weight file -> its tensors in file order, with their byte ranges."""
        ...


def checkpoint_reader(weights: str = WEIGHTS) -> CheckpointReader:
    """The reader a backend declared for ``weights`` files (imported on first use)."""
    return cast(CheckpointReader, plugins.provide(plugins.declared("CHECKPOINTS")[weights]))

"""The tensors an HF-style model directory declares, read from its safetensors headers before anything
loads it: the inventory the frontend's no-random-weights gate compares with the model it builds.

``checkpoint_inventory(dir)`` finds the checkpoint the way transformers does (``model.safetensors``,
or ``model.safetensors.index.json`` and the shards it names), opens every file under the source path
policy (``qcompiler.paths.SOURCE``) and the strict container reader (a truncated or malformed
shard is a ``ContainerError`` naming the file and field, before transformers sees it), and returns
tensor name -> ``Declared(file, dtype, shape)``. ``read_declared`` gives one tensor's bytes (for a
tied alias that must equal its twin).

    inventory = checkpoint_inventory(Path("llama-dir"))
    inventory["model.embed_tokens.weight"]   # Declared(file='model.safetensors', dtype='F32', shape=(128, 64))
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from qcompiler.artifact.reader import parse_json
from qcompiler.backends.safetensors.container import open_file
from qcompiler.errors import FileError
from qcompiler.frontend.reading import SourceTensor
from qcompiler.paths import SOURCE, PathError, check_rel, open_in, read_bounded

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 * 2**20
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


class CheckpointError(FileError):
    """A source directory's checkpoint files are missing, malformed or inconsistent."""


@dataclass(frozen=True)
class Declared:
    """One tensor a checkpoint declares: its file, safetensors dtype and shape."""

    file: str
    dtype: str
    shape: tuple[int, ...]


def shard_names(root: Path) -> list[str]:
    """The checkpoint files of ``root``: ``model.safetensors``, or the shards the index names."""
    if (root / INDEX).exists():
        try:
            index = parse_json(read_bounded(root, INDEX, MAX_INDEX_BYTES, SOURCE), INDEX)
        except PathError as e:
            raise CheckpointError(e.message, file=e.file, field=e.field, expected=e.expected, found=e.found) from None
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not wmap or not all(isinstance(v, str) for v in wmap.values()):
            raise CheckpointError(
                "must hold a non-empty weight_map of tensor -> shard file",
                file=INDEX,
                field="weight_map",
                found=type(wmap).__name__,
            )
        names = sorted(set(wmap.values()))
        for name in names:
            try:
                check_rel(name, file=INDEX, field="weight_map")
            except PathError as e:
                raise CheckpointError(e.message, file=INDEX, field="weight_map", found=repr(name)) from None
        return names
    if (root / SINGLE).exists():
        return [SINGLE]
    pickled = [p for p in PICKLES if (root / p).exists()]
    raise CheckpointError(
        "no safetensors weights: this directory has a config but no checkpoint qcompiler reads",
        file=str(root),
        field="weights",
        expected=f"{SINGLE} or {INDEX}",
        found=f"{pickled[0]} (a pickle; convert it to safetensors)" if pickled else "no weight files",
    )


def checkpoint_inventory(root: Path) -> dict[str, Declared]:
    """Tensor name -> ``Declared`` for every tensor of ``root``'s checkpoint (see the module docstring)."""
    out: dict[str, Declared] = {}
    for name in shard_names(root):
        try:
            fh, _ = open_in(root, name, SOURCE, field="shard")
        except PathError as e:
            raise CheckpointError(e.message, file=e.file, field=e.field, expected=e.expected, found=e.found) from None
        f = open_file(resolved(root, name), fh=fh)
        for tensor, entry in f.tensors.items():
            if tensor in out:
                raise CheckpointError(
                    "tensor stored in two shards", file=name, tensor=tensor, found=f"also in {out[tensor].file}"
                )
            out[tensor] = Declared(name, entry.dtype, entry.shape)
    if (root / INDEX).exists():
        _check_index(root, out)
    return out


def _check_index(root: Path, declared: dict[str, Declared]) -> None:
    index = parse_json(read_bounded(root, INDEX, MAX_INDEX_BYTES, SOURCE), INDEX)
    wmap: dict[str, str] = index["weight_map"]
    for tensor, d in sorted(declared.items()):
        if wmap.get(tensor) != d.file:
            raise CheckpointError(
                "the index and the shards disagree",
                file=INDEX,
                tensor=tensor,
                field="weight_map",
                expected=d.file,
                found=wmap.get(tensor, "not listed"),
            )
    for tensor in sorted(set(wmap) - set(declared)):
        raise CheckpointError(
            "listed in the weight_map but in no shard",
            file=INDEX,
            tensor=tensor,
            field="weight_map",
            found=wmap[tensor],
        )


def read_declared(root: Path, d: Declared, tensor: str) -> bytes:
    """The bytes of one declared tensor, read through the path policy and the strict reader."""
    fh, _ = open_in(root, d.file, SOURCE, field="shard")
    return open_file(resolved(root, d.file), fh=fh).read(tensor)


def shard_tensors(root: Path) -> dict[str, list[SourceTensor]]:
    """Shard file -> its tensors in file order, each with its absolute byte range in the file."""
    out: dict[str, list[SourceTensor]] = {}
    for file in shard_names(root):
        f = open_file(resolved(root, file))
        entries = sorted(f.tensors.values(), key=lambda e: e.begin)
        out[file] = [SourceTensor(file, e.name, e.dtype, e.shape, f.data_start + e.begin, e.nbytes) for e in entries]
    return out


def resolved(root: Path, name: str) -> Path:
    """Where a source file really is (an HF cache snapshot links into ``blobs/``): later reads reopen
    that path without following links and prove it is the file that was checked."""
    return Path(os.path.realpath(root / name))

"""A module's tensors made readable from another process: the blob store's in-memory blobs, and files
outside the target directory, written beside the IR as content-addressed files (``--dump-ir``,
``qcompiler opt -o``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from qcompiler.ir.blobs import in_store, read_pieces
from qcompiler.ir.core import Module, TensorDecl


def relocate_to_files(m: Module, directory: Path, subdir: str = "blobs") -> Module:
    """A shallow copy of ``m`` whose printed IR, saved in ``directory``, can be re-read with its bytes
    in another process: in-memory blobs held by this process, and files outside ``directory``, are
    written to ``directory/subdir/<sha256>.bin`` (content-addressed, each once, hash checked, a few MB
    at a time); files inside ``directory`` are referenced relative to it. A container location
    (``safetensors:``, ``gguf:``, ...) is kept where ``m`` already lives in ``directory``, else copied
    the same way: a streamed compile's dense tensors live in the source's shards."""
    (directory / subdir).mkdir(parents=True, exist_ok=True)
    root = directory.resolve()
    tensors: dict[str, TensorDecl] = {}
    for name, decl in m.tensors.items():
        location = movable_location(decl, Path(m.base_dir or "."), root, subdir)
        if location is None:
            tensors[name] = decl
            continue
        if location.startswith(f"file:{subdir}/"):
            path = directory / location.removeprefix("file:")
            if not path.exists():
                tmp = path.with_suffix(".tmp")
                with tmp.open("wb") as fh:
                    for piece in read_pieces(decl, m.base_dir):
                        fh.write(piece)
                tmp.replace(path)
        blob = dataclasses.replace(decl.blob, location=location)
        tensors[name] = TensorDecl(name, blob, decl.attrs, decl.comments, decl.loc)
    return dataclasses.replace(m, tensors=tensors, base_dir=str(directory))


def movable_location(decl: TensorDecl, base: Path, root: Path, subdir: str) -> str | None:
    """Where ``decl`` should point from ``root``; ``None`` to leave it as it is."""
    scheme, _, rest = decl.blob.location.partition(":")
    content_addressed = f"file:{subdir}/{decl.blob.sha256}.bin"
    if scheme == "mem":
        return content_addressed if in_store(decl.blob.sha256) else None
    if scheme != "file":
        return None if base.resolve() == root else content_addressed
    rel, _, offset = rest.partition("@")
    target = (base / rel).resolve()
    if target.is_relative_to(root):
        return f"file:{target.relative_to(root)}" + (f"@{offset}" if offset else "")
    return content_addressed

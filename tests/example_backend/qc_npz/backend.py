"""``--target npz`` (see the package docstring): ``weights.npz`` holds each IR tensor as the IR holds
it (bf16 as its raw ``uint16`` bits), ``graph.qir`` points at them as ``npz:weights.npz#NAME``."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from qcompiler.artifact.publish import Finish, finish, relocated
from qcompiler.artifact.reader import ArtifactError, read_graph
from qcompiler.artifact.request import ArtifactRequest, ContainerEntry, OpenedArtifact
from qcompiler.artifact.writer import ArtifactWriter
from qcompiler.backends.base import Backend, ContainerTensor, LayoutPlan
from qcompiler.errors import BlobError
from qcompiler.ir.blobs import open_blob_file, read_array, reader
from qcompiler.ir.core import BlobRef, Module
from qcompiler.ir.printer import print_module
from qcompiler.ir.types import PackSpec, QuantType

WEIGHTS = "weights.npz"


class NpzBackend(Backend):
    name: ClassVar[str] = "npz"
    container: ClassVar[str] = "npz/1"
    shardable: ClassVar[bool] = False

    def plan(self, name: str, t: QuantType, prefer: str = "", model_dtype: str = "") -> LayoutPlan:
        return LayoutPlan("exact", pack=PackSpec("npz-codes"))  # one code per byte (layouts.py)

    def container_tensors(self, m: Module) -> list[ContainerTensor]:
        return [ContainerTensor(n, d.blob.dtype.name, d.blob.shape, d.blob.nbytes, (n,)) for n, d in m.tensors.items()]

    def shard_file_names(self, count: int) -> list[str]:
        return [WEIGHTS]

    def emit(self, m: Module, request: ArtifactRequest) -> Path:
        buf = io.BytesIO()
        np.savez(buf, **{n: read_array(m, n) for n in m.tensors})  # type: ignore[arg-type]
        with ArtifactWriter(request.out, fail_at=request.fail_at, force=request.force) as w:
            w.write_file(WEIGHTS, buf.getvalue())
            graph = relocated(m, {n: f"npz:{WEIGHTS}#{n}" for n in m.tensors})
            w.write_file("graph.qir", print_module(graph).encode())
            how = Finish("npz", lambda p: self.open(p, None), self.container, topology={"file_shards": 1})
            finish(w, m, request, how)
        return request.out

    def open(self, path: Path, manifest: dict[str, Any] | None) -> OpenedArtifact:
        m = read_graph(path)  # every tensor read through the npz: scheme, its sha256 checked
        with zipfile.ZipFile(path / WEIGHTS) as z:
            held = {n.removesuffix(".npy") for n in z.namelist()}
        if held != set(m.tensors):
            raise ArtifactError("weights.npz does not hold exactly graph.qir's tensors", file=WEIGHTS)
        entries = [
            ContainerEntry(n, WEIGHTS, d.blob.dtype.name, d.blob.shape, d.blob.nbytes) for n, d in m.tensors.items()
        ]
        return OpenedArtifact(path, "npz", manifest, m, entries, ["graph", "npz"], {}, {WEIGHTS, "graph.qir"})


@reader("npz")
def read_npz(ref: BlobRef, rest: str, base: Path) -> bytes:
    """``npz:FILE#NAME``: array ``NAME`` of ``FILE`` (no pickles), as little-endian bytes."""
    rel, _, name = rest.partition("#")
    fh, _ = open_blob_file(base, rel, "npz")
    with fh, np.load(fh, allow_pickle=False) as z:
        if name not in z.files:
            raise BlobError(f"{rel} holds no array {name!r}")
        return np.ascontiguousarray(z[name]).tobytes()

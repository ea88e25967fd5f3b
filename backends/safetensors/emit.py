"""Write a compressed-tensors checkpoint artifact, transactionally, and prove it before publishing.

Files: ``model.safetensors`` (or ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``),
``config.json`` (the source's, plus ``quantization_config``), the source's tokenizer files as they
were, ``graph.qir`` (the final QIR; its tensors point into the shards, and its ``bound`` record holds
the sha256 of each config.json key, of the index and of each carried file), ``graph.safetensors``
(graph constants the checkpoint does not hold, if any), and ``manifest.json`` last.

Before the manifest is written, the temp directory is reopened through the production reader and
parity rungs 1-3 run on what it rebuilt; the manifest records the evidence; the finished directory
is opened once more through every gate (manifest and hashes included) before the atomic swap.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from qcompiler.artifact.manifest import (
    canonical_sha256,
)
from qcompiler.artifact.publish import EmitError, Finish, finish, relocated
from qcompiler.artifact.request import ArtifactRequest
from qcompiler.artifact.writer import ArtifactWriter
from qcompiler.backends.base import ContainerTensor
from qcompiler.backends.safetensors import ct_config, mixprec_schema
from qcompiler.backends.safetensors.blobs import METADATA
from qcompiler.backends.safetensors.container_write import TensorBytes, chunks, file_offsets, layout
from qcompiler.backends.safetensors.inventory import InventoryError, architecture_inventory
from qcompiler.backends.safetensors.layouts import pack_dim0, unpack_dim0
from qcompiler.backends.safetensors.plan import (
    GRAPH_FILE,
    INDEX,
    ST_DTYPE,
    Weight,
    container_tensors,
    quant_weights,
    shard_file_names,
)
from qcompiler.backends.safetensors.read import CONFIG, CONFIG_SECTION, FILES_SECTION, config_digests, open_safetensors
from qcompiler.errors import UsageError
from qcompiler.ir.blob_spill import moved
from qcompiler.ir.blobs import read_array, read_blob, read_pieces, vouch
from qcompiler.ir.core import Module, TensorDecl
from qcompiler.ir.facts import with_record
from qcompiler.ir.module_attrs import activation_schemes
from qcompiler.ir.printer import print_module

CHECKPOINT_FORMAT = "compressed-tensors pack-quantized (dense bit packing, compressed-tensors >= 0.17)"
TESTED_RUNTIMES = {"transformers": "5.24.0", "compressed-tensors": "0.20.1"}
"""Versions the test suite loads these artifacts with."""


def verbatim(
    m: Module, ct: ContainerTensor, by_module: dict[str, Weight], shapes: dict[str, bytes]
) -> TensorDecl | None:
    """The tensor-table entry whose bytes ``ct`` holds as they are, or ``None`` where the container
    holds bytes made here (a weight's shape, zero points packed along dim 0)."""
    module, _, suffix = ct.name.rpartition(".")
    w = by_module.get(module) if suffix.startswith("weight_") else None  # FP8 ``weight``: the codes, as stored
    if ct.name in shapes:  # a mixprec ``weight_shape``; its other tensors are the IR's bytes
        return None
    if w is None:
        return m.tensors[ct.owners[0]]
    return m.tensors[w.codes] if suffix == "weight_packed" else m.tensors[w.scale] if suffix == "weight_scale" else None


def tensor_data(
    m: Module, ct: ContainerTensor, by_module: dict[str, Weight], shapes: dict[str, bytes]
) -> bytes | memoryview | Iterator[bytes | memoryview]:
    decl = verbatim(m, ct, by_module, shapes)
    if decl is not None and decl.blob.location != "mem":  # a source tensor: copied a few MB at a time
        return read_pieces(decl, m.base_dir)
    if decl is not None:
        return read_blob(decl, m.base_dir)
    if ct.name in shapes:
        return shapes[ct.name]
    module, _, suffix = ct.name.rpartition(".")
    w = by_module[module]
    if suffix == "weight_shape":
        return np.array([int(d) for d in w.t.shape], dtype="<i8").tobytes()
    assert w.zero is not None
    zero = read_array(m, w.zero).astype(np.int64)
    lo, hi = w.t.code.alphabet.lo, w.t.code.alphabet.hi
    if zero.min() < lo or zero.max() > hi:
        raise EmitError(
            f"{w.name}: zero points outside [{lo}, {hi}] cannot be packed as {w.t.code.dtype.bits}-bit values"
        )
    packed = pack_dim0(zero, w.t.code.dtype.bits)
    if not np.array_equal(unpack_dim0(packed, w.t.code.dtype.bits, zero.shape[0]), zero):
        raise EmitError(f"{w.name}: zero points do not survive packing along dim 0")
    return packed.astype("<i4").tobytes()


class ShardWrite:
    """One file's tensors as written (``ArtifactWriter.write_file``'s ``written``): each spilled blob
    the file now holds is read from it from then on, and its spill file goes (``blob_spill.moved``):
    its pages are the next tensors' (a 1.1B model's 0.5 GB of codes). Once the file is whole,
    ``vouch`` records that each tensor written as the IR's bytes holds them, for reads of that same
    file (``blobs.vouch``): the reopen's checks then hash the file's codes once, not twice (they were
    hashed as they were stored; the file's own sha256 as it was written)."""

    def __init__(self, head: bytes, ordered: list[TensorBytes], decls: dict[str, TensorDecl | None]) -> None:
        offsets = file_offsets(head, ordered)
        self.at: dict[tuple[int, int], str] = {}
        self.held: dict[str, str] = {}
        for t in ordered:
            decl = decls.get(t.name)
            if decl is None:
                continue
            self.held[t.name] = decl.blob.sha256
            if decl.blob.location == "mem" and decl.blob.nbytes:
                self.at[(offsets[t.name], decl.blob.nbytes)] = decl.blob.sha256

    def __call__(self, offset: int, length: int, path: Path) -> None:
        sha = self.at.get((offset, length))
        if sha is not None:
            moved(sha, path, offset)

    def vouch(self, root: Path, file: str) -> None:
        st = (root / file).stat()
        for name, sha in self.held.items():
            vouch(f"safetensors:{file}#{name}", str(root), file, sha, st)


def location(ct: ContainerTensor, file: str, owner: str, w: Weight | None) -> str:
    if w is not None and owner == w.zero:
        return f"ct-zero:{file}#{w.module}.weight_zero_point@{w.t.code.dtype.bits}"
    if w is not None and w.t.family == "f8e4m3":  # the codes are the F8_E4M3 ``weight``; one scale: [1]
        if owner == w.codes:
            return f"safetensors:{file}#{w.module}.weight"
        return f"{'ct-scale' if w.t.group is None else 'safetensors'}:{file}#{w.module}.weight_scale"
    if w is not None:
        return f"safetensors:{file}#{w.module}.weight_{'packed' if owner == w.codes else 'scale'}"
    return f"safetensors:{file}#{ct.name}"


def check_coverage(m: Module, config: dict[str, Any], cts: list[ContainerTensor]) -> list[str]:
    """The checkpoint must hold exactly the architecture's tensors; returns the dense Linears."""
    try:
        inv = architecture_inventory(config)
    except InventoryError as e:
        raise EmitError(f"config.json: {e}") from None
    quantized = {w.module for w in quant_weights(m)} | {w.module for w in mixprec_schema.mixprec_weights(m)}
    have = {ct.name for ct in cts if ct.file == "model"} | {f"{q}.weight" for q in quantized}
    have -= {
        ct.name
        for ct in cts
        if ct.name.rpartition(".")[0] in quantized and ct.name.rpartition(".")[2].startswith("weight_")
    }
    missing = sorted(set(inv.tensors) - have)
    extra = sorted(have - set(inv.tensors))
    if missing:
        raise EmitError(
            f"the module lacks {len(missing)} tensor(s) {inv.architecture} needs, first {missing[0]!r} "
            "(unused by the graph and not carried)"
        )
    if extra:
        raise EmitError(
            f"the module holds {len(extra)} tensor(s) {inv.architecture} does not have, first {extra[0]!r}; "
            'graph-only constants must say role = "constant"'
        )
    return sorted(n for n in inv.linears if n not in quantized)


def quantization_config(
    m: Module, weights: list[Weight], mix: list[mixprec_schema.MixWeight], dense_linears: list[str]
) -> dict[str, Any]:
    """compressed-tensors' config, or our own block when every quantized weight is ``mixprec``."""
    if not mix:
        return ct_config.build({w.module: w.t for w in weights}, dense_linears, activation_schemes(m))
    if weights:
        raise EmitError(
            f"{mix[0].name}: mixprec weights have no compressed-tensors form and {weights[0].name} has no "
            "mixprec form; one safetensors checkpoint holds one or the other (expected all mixprec or none, "
            f"found {len(mix)} mixprec and {len(weights)} compressed-tensors weights)"
        )
    try:
        return mixprec_schema.config_block(mix, dense_linears)
    except ct_config.ConfigError as e:
        raise EmitError(str(e)) from None


def checkpoint_format(config: dict[str, Any]) -> str:
    """What the checkpoint is, by its ``quantization_config``."""
    qc = config.get("quantization_config")
    return mixprec_schema.CHECKPOINT_FORMAT if mixprec_schema.is_mixprec(qc) else CHECKPOINT_FORMAT


def emitted_versions(config: dict[str, Any]) -> dict[str, Any]:
    """The manifest's versions: the checkpoint format, and (compressed-tensors only) the runtimes tested."""
    fmt = checkpoint_format(config)
    return {"checkpoint_format": fmt} | ({"tested_runtime": TESTED_RUNTIMES} if fmt == CHECKPOINT_FORMAT else {})


def emit(m: Module, req: ArtifactRequest) -> Path:
    src = req.source
    if src is None or src.config is None:
        raise UsageError(
            "target safetensors writes a transformers checkpoint, so the source must be a transformers model "
            f"with a config ({src.spec if src else 'this module'} has none)"
        )
    cts = container_tensors(m)
    dense_linears = check_coverage(m, src.config, cts)
    weights = quant_weights(m)
    by_module = {w.module: w for w in weights}
    by_owner = {o: w for w in weights for o in (w.codes, w.scale, w.zero) if o}
    mix = mixprec_schema.mixprec_weights(m)
    mix_owner = {o: w.name for w in mix for o in w.refs.values()}
    shapes = {f"{w.module}.weight_shape": np.array(w.t.shape, dtype="<i8").tobytes() for w in mix}
    qc = quantization_config(m, weights, mix, dense_linears)
    shards = m.attrs.get("file_shards")
    count = int(shards.get("count", 1)) if isinstance(shards, dict) else 1  # type: ignore[arg-type]
    max_size = shards.get("max_size") if isinstance(shards, dict) else None
    names = shard_file_names(count)
    files: dict[str, list[TensorBytes]] = {}
    locations: dict[str, str] = {}
    for ct in cts:
        shard = m.tensors[ct.owners[0]].attrs.get("file_shard", 1)
        file = GRAPH_FILE if ct.file == "graph" else names[int(shard) - 1]  # type: ignore[arg-type]
        files.setdefault(file, []).append(
            TensorBytes(ct.name, ST_DTYPE[ct.dtype], ct.shape, functools.partial(tensor_data, m, ct, by_module, shapes))
        )
        for owner in ct.owners:  # a mixprec weight's planes come before its shape: they locate its codes
            locations.setdefault(owner, location(ct, file, owner, by_owner.get(owner)))
    config = dict(src.config)
    config.pop("quantization_config", None)
    if weights or mix:  # with every weight converted to dense this is a plain checkpoint
        config["quantization_config"] = qc
    graph = relocated(m, locations)
    stored: dict[str, int] = {}
    for ct in cts:
        w = by_owner.get(ct.owners[0])
        name = w.name if w is not None else mix_owner.get(ct.owners[0])
        if name is not None:
            stored[name] = stored.get(name, 0) + ct.nbytes
    quantized = {**by_owner, **mix_owner}
    all_params = sum(int(np.prod(ct.shape)) for ct in cts if ct.file == "model" and ct.owners[0] not in quantized)
    all_params += sum(int(w.t.shape[0]) * int(w.t.shape[1]) for w in [*weights, *mix])
    carried: dict[str, str] = {}
    with ArtifactWriter(req.out, fail_at=req.fail_at, force=req.force) as w:
        decls = {ct.name: verbatim(m, ct, by_module, shapes) for ct in cts}
        for file in [*names, GRAPH_FILE]:
            if file in files:
                head, ordered = layout(files[file], METADATA)
                shard = ShardWrite(head, ordered, decls)
                w.write_file(file, chunks(head, ordered), written=shard)
                shard.vouch(w.tmp, file)
        if count > 1:
            index = {
                "metadata": {
                    "total_size": sum(ct.nbytes for ct in cts if ct.file == "model"),
                    "total_parameters": all_params,
                },
                "weight_map": {t.name: f for f in names for t in files.get(f, [])},
            }
            carried[INDEX] = w.write_file(INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()).sha256
        config_bytes = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
        w.write_file(CONFIG, config_bytes)
        for name, data in sorted(src.files.items()):
            carried[name] = w.write_file(name, data).sha256
        record = {CONFIG_SECTION: config_digests(json.loads(config_bytes)), FILES_SECTION: carried}
        w.write_file("graph.qir", print_module(with_record(graph, record)).encode())
        finish(
            w,
            m,
            req,
            Finish(
                target="safetensors",
                reopen=lambda path: open_safetensors(path, None),
                container="safetensors/1",
                versions=emitted_versions(config),
                provenance={"quantization_config_sha256": canonical_sha256(config.get("quantization_config"))},
                topology={"file_shards": count, "max_shard_size": max_size},
                stored=stored,
                all_params=all_params,
            ),
        )
    return req.out

"""Gate ``derived``: every manifest field a reader or the runtime interprets agrees with the artifact.

The manifest restates facts the artifact's own files hold. A careless tool that edits a file and
re-hashes the manifest's ``files`` list leaves these behind, and an edit of the manifest alone makes
them disagree; either way the reader refuses, naming the field:

| field | must equal |
|---|---|
| ``versions.container``, ``versions.graph`` | what this reader reads (the backend's container, ``GRAPH_VERSION``) |
| ``versions.quant_representation``, ``versions.packing_layout`` | the set graph.qir's descriptors name |
| ``versions.<target's own keys>`` | ``Backend.versions(opened)``: what the backend writes for this artifact |
| any other ``versions`` key | refused, unless the backend lists it as descriptive (``tested_runtime``) |
| ``topology.tp``, ``topology.pp`` | graph.qir's ``topology``; ``placement`` ``replicate`` |
| ``topology.file_shards``, ``topology.max_shard_size`` | ``file_shards`` (count; max size, if shardable) |
| ``conversions`` | graph.qir's ``conversions`` record, entry for entry |
| ``provenance.<restated keys>`` | ``Backend.provenance(opened)`` (compressed-tensors: quantization config sha256) |
| ``tokenizer_sha256`` | the tokenizer files the artifact carries, when it carries any |
| ``files`` | only files the target's gates read or bound (``OpenedArtifact.files``) |

What stays unchecked is descriptive only (free-text provenance, ``model``, the rate ledger, tested
runtimes): no consumer computes with it, and only a signature (``qcompiler sign``) protects it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qcompiler.artifact.manifest import GRAPH_VERSION, TOKENIZER_FILES, files_sha256
from qcompiler.artifact.reader import MANIFEST, MAX_JSON_BYTES, ArtifactError
from qcompiler.artifact.request import OpenedArtifact
from qcompiler.ir.core import Module
from qcompiler.paths import read_bounded

if TYPE_CHECKING:
    from qcompiler.backends.base import Backend

CORE_VERSIONS = ("artifact_schema", "container", "graph", "quant_representation", "packing_layout")


def disagree(field: str, want: object, found: object, what: str = "graph.qir") -> ArtifactError:
    return ArtifactError(f"disagrees with {what}", file=MANIFEST, field=field, expected=want, found=found)


def canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def expected_versions(opened: OpenedArtifact, backend: Backend) -> dict[str, Any]:
    from qcompiler.parity import weights

    model = weights(opened.module)
    return {
        "container": backend.container,
        "graph": GRAPH_VERSION,
        "quant_representation": sorted({f"{t.family}/decoder-{t.decoder}" for _, _, t in model}),
        "packing_layout": sorted({f"{t.pack.family}/v{t.pack.version}" for _, _, t in model}),
        "required_kernels": [],
        **backend.versions(opened),
    }


def check_versions(manifest: dict[str, Any], opened: OpenedArtifact, backend: Backend) -> None:
    versions: dict[str, Any] = manifest["versions"]
    want = expected_versions(opened, backend)
    for key, value in want.items():
        if canonical(versions.get(key)) != canonical(value):
            raise disagree(f"versions.{key}", value, versions.get(key), f"what the {backend.name} reader reads")
    known = {*want, "artifact_schema", *backend.descriptive_versions}
    for key in sorted(set(versions) - known):
        raise ArtifactError(
            f"not a version the {backend.name} target records",
            file=MANIFEST,
            field=f"versions.{key}",
            expected=" | ".join(sorted(known)),
            found=key,
        )


def check_provenance(manifest: dict[str, Any], opened: OpenedArtifact, backend: Backend) -> None:
    provenance: dict[str, Any] = manifest["provenance"]
    for key, value in backend.provenance(opened).items():
        if canonical(provenance.get(key)) != canonical(value):
            raise disagree(f"provenance.{key}", value, provenance.get(key), "the artifact's files")


def check_topology(manifest: dict[str, Any], m: Module, shardable: bool) -> None:
    topo: dict[str, Any] = manifest["topology"]
    graph_topo = m.attrs.get("topology")
    graph_topo = graph_topo if isinstance(graph_topo, dict) else {"tp": 1, "pp": 1}
    shards = m.attrs.get("file_shards")
    shards = shards if isinstance(shards, dict) else {}
    want: dict[str, object] = {
        "tp": graph_topo.get("tp", 1),
        "pp": graph_topo.get("pp", 1),
        "placement": "replicate",
        "file_shards": shards.get("count", 1),
    }
    if shardable:  # a target that shards its container records the limit it sharded by
        want["max_shard_size"] = shards.get("max_size")
    for key, value in want.items():
        if canonical(topo.get(key)) != canonical(value):
            raise disagree(f"topology.{key}", value, topo.get(key))
    for key in sorted(set(topo) - set(want)):
        raise ArtifactError("not a topology field", file=MANIFEST, field=f"topology.{key}", found=key)


def check_conversions(manifest: dict[str, Any], m: Module) -> None:
    recorded = m.attrs.get("conversions") or []
    if canonical(manifest["conversions"]) != canonical(recorded):
        listed = manifest["conversions"]
        raise disagree(
            "conversions",
            f"{len(recorded) if isinstance(recorded, list) else '?'} record(s) as graph.qir holds them",
            f"{len(listed)} record(s) that differ",
        )


def check_files(root: Path, manifest: dict[str, Any], files: set[str]) -> None:
    listed = {str(e["path"]) for e in manifest["files"]}
    for extra in sorted(listed - files):
        raise ArtifactError(
            "listed in the manifest, but no gate of this target reads or binds it (its consumers would ignore it)",
            file=extra,
            expected=" | ".join(sorted(files)),
            found="an extra file",
        )
    carried = {n: read_bounded(root, n, MAX_JSON_BYTES) for n in TOKENIZER_FILES if n in listed}
    if carried and files_sha256(carried) != manifest["tokenizer_sha256"]:
        raise disagree("tokenizer_sha256", files_sha256(carried), manifest["tokenizer_sha256"], "the tokenizer files")


def check_derived(root: Path, manifest: dict[str, Any], opened: OpenedArtifact, backend: Backend) -> None:
    """Gate ``derived`` (see the module docstring)."""
    check_versions(manifest, opened, backend)
    check_provenance(manifest, opened, backend)
    check_topology(manifest, opened.module, backend.shardable)
    check_conversions(manifest, opened.module)
    check_files(root, manifest, opened.files)

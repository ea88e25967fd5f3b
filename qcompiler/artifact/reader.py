"""The production reader: every artifact is untrusted input, checked before anything large is read.

``open_artifact(path)`` runs the gates in order and returns an ``OpenedArtifact``:

1. ``manifest``: bounded read (``MAX_JSON_BYTES``), strict JSON (duplicate keys refused), its
   ``self_sha256`` matches its own canonical JSON, known schema version and target;
2. ``files``: every listed file is a relative path inside the artifact, a regular file (no
   symlink), of the listed size and sha256; no file is present that the manifest does not list;
3. the target backend's own gates (container, index, inventory, qparams, graph).

Every rejection is an ``ArtifactError`` naming the file, tensor and field, with expected and found.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from qcompiler.artifact.manifest import ARTIFACT_SCHEMA
from qcompiler.artifact.request import OpenedArtifact
from qcompiler.artifact.writer import MANIFEST, SELF_DIGEST, manifest_digest
from qcompiler.errors import FileError, QcError
from qcompiler.ir.core import Module

MAX_JSON_BYTES = 64 * 2**20
_SHA = re.compile(r"^[0-9a-f]{64}$")


class ArtifactError(FileError):
    """An artifact failed a reader gate. ``str(e)`` is ``FILE: tensor 'T': FIELD: message (expected E, found F)``."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def read_json(path: Path, rel: str, limit: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON file strictly, refusing files over ``limit`` bytes before reading them."""
    try:
        st = os.lstat(path)
    except OSError:
        raise ArtifactError("missing", file=rel) from None
    if not stat.S_ISREG(st.st_mode):
        raise ArtifactError("not a regular file", file=rel, expected="a regular file", found="a link or special file")
    if st.st_size > limit:
        raise ArtifactError("too large to be a metadata file", file=rel, expected=f"<= {limit} bytes", found=st.st_size)
    try:
        return json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise ArtifactError(f"invalid JSON: {e}", file=rel) from None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


MAX_GRAPH_BYTES = 256 * 2**20
"""Largest ``graph.qir`` a reader parses."""


def read_graph(root: Path) -> Module:
    """The artifact's ``graph.qir``, size-bounded, parsed and verified with every tensor's bytes read
    from the container (sha256 and code ranges checked): the ``graph`` gate every backend shares."""
    from qcompiler.ir.parser import parse_module
    from qcompiler.ir.verifier import verify_module

    path = root / "graph.qir"
    if not path.is_file():
        raise ArtifactError("missing", file="graph.qir")
    if path.stat().st_size > MAX_GRAPH_BYTES:
        raise ArtifactError(
            "too large", file="graph.qir", expected=f"<= {MAX_GRAPH_BYTES} bytes", found=path.stat().st_size
        )
    try:
        m = parse_module(path.read_text(), str(path))
        m.base_dir = str(root)
        verify_module(m, data=True)
    except (QcError, OSError) as e:
        raise ArtifactError(str(e), file="graph.qir") from None
    return m


def check_files(root: Path, manifest: dict[str, Any]) -> None:
    """Gate ``files``: the manifest's file list against the directory, sizes and hashes."""
    listed = manifest.get("files")
    if not isinstance(listed, list):
        raise ArtifactError(
            "must be a list",
            file=MANIFEST,
            field="files",
            expected="[{path, size, sha256}, ...]",
            found=type(listed).__name__,
        )
    seen: set[str] = set()
    for i, entry in enumerate(listed):
        field = f"files[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"path", "size", "sha256"}:
            raise ArtifactError(
                "malformed entry", file=MANIFEST, field=field, expected="{path, size, sha256}", found=entry
            )
        rel, size, digest = entry["path"], entry["size"], entry["sha256"]
        if (
            not isinstance(rel, str)
            or not rel
            or rel.startswith("/")
            or ".." in Path(rel).parts
            or rel == MANIFEST
            or rel in seen
        ):
            raise ArtifactError(
                "path must be relative, inside the artifact, and listed once",
                file=MANIFEST,
                field=f"{field}.path",
                found=repr(rel),
            )
        if (
            not isinstance(size, int)
            or isinstance(size, bool)
            or size < 0
            or not isinstance(digest, str)
            or not _SHA.match(digest)
        ):
            raise ArtifactError(
                "size must be an integer and sha256 64 hex digits", file=MANIFEST, field=field, found=entry
            )
        seen.add(rel)
        path = root / rel
        try:
            st = os.lstat(path)
        except OSError:
            raise ArtifactError("listed in the manifest but missing", file=rel) from None
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError(
                "not a regular file", file=rel, expected="a regular file", found="a symlink or special file"
            )
        if st.st_size != size:
            raise ArtifactError(
                "size differs from the manifest", file=rel, field="size", expected=size, found=st.st_size
            )
        found = sha256_file(path)
        if found != digest:
            raise ArtifactError(
                "content differs from the manifest", file=rel, field="sha256", expected=digest, found=found
            )
    present = {p.relative_to(root).as_posix() for p in root.rglob("*") if not p.is_dir()} - {MANIFEST}
    for extra in sorted(present - seen):
        raise ArtifactError("file is not listed in the manifest", file=extra)


def read_manifest(root: Path) -> dict[str, Any]:
    if not root.is_dir():
        raise ArtifactError("not an artifact directory", file=str(root))
    manifest = read_json(root / MANIFEST, MANIFEST)
    if not isinstance(manifest, dict):
        raise ArtifactError("must be a JSON object", file=MANIFEST, found=type(manifest).__name__)
    digest = manifest_digest(manifest)
    if manifest.get(SELF_DIGEST) != digest:
        raise ArtifactError(
            "the manifest's own content changed",
            file=MANIFEST,
            field=SELF_DIGEST,
            expected=digest,
            found=manifest.get(SELF_DIGEST),
        )
    versions = manifest.get("versions")
    schema = versions.get("artifact_schema") if isinstance(versions, dict) else None
    if schema != ARTIFACT_SCHEMA:
        raise ArtifactError(
            "unknown artifact schema",
            file=MANIFEST,
            field="versions.artifact_schema",
            expected=ARTIFACT_SCHEMA,
            found=schema,
        )
    return manifest


def open_artifact(path: Path | str) -> OpenedArtifact:
    """Open a published artifact through every gate (see the module docstring)."""
    from qcompiler.backends import BACKENDS, get_backend

    root = Path(path)
    manifest = read_manifest(root)
    target = manifest.get("target")
    if target not in BACKENDS:
        raise ArtifactError(
            "unknown target", file=MANIFEST, field="target", expected=" | ".join(BACKENDS), found=target
        )
    check_files(root, manifest)
    opened = get_backend(str(target)).open(root, manifest)
    opened.gates[:0] = ["manifest", "files"]
    return opened

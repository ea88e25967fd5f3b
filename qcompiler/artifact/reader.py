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
import threading
from pathlib import Path
from typing import Any, BinaryIO

from qcompiler.artifact import manifest_schema
from qcompiler.artifact.request import OpenedArtifact
from qcompiler.artifact.writer import MANIFEST, SELF_DIGEST, SIGNATURE, manifest_digest
from qcompiler.errors import FileError, ParseError, QcError, VerifyError
from qcompiler.ir.core import Module
from qcompiler.paths import ARTIFACT, Identity, PathError, check_rel, open_in, read_bounded, walk

MAX_JSON_BYTES = 64 * 2**20
MAX_JSON_DEPTH = 64
"""Deepest nesting of a metadata file (a manifest nests about 6 deep)."""
GRAPH = "graph.qir"
_SHA = re.compile(r"^[0-9a-f]{64}$")
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


class ArtifactError(FileError):
    """An artifact failed a reader gate. ``str(e)`` is ``FILE: tensor 'T': FIELD: message (expected E, found F)``."""


def as_artifact(e: FileError) -> ArtifactError:
    """A path-policy refusal (or any ``FileError``) as the artifact gate's error, same fields."""
    return ArtifactError(e.message, file=e.file, tensor=e.tensor, field=e.field, expected=e.expected, found=e.found)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def parse_json(data: bytes, rel: str) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity, nesting at most ``MAX_JSON_DEPTH``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ArtifactError(f"not UTF-8 ({e.reason} at byte {e.start})", file=rel) from None
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ArtifactError("JSON nested too deep", file=rel, expected=f"<= {MAX_JSON_DEPTH} levels", found=depth)
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except ValueError as e:
        raise ArtifactError(f"invalid JSON: {e}", file=rel) from None


def json_depth(text: str) -> int:
    """The deepest bracket nesting of a JSON text (brackets inside strings ignored), in one pass
    without recursion, so a file nested 100,000 deep is refused before ``json`` recurses into it."""
    depth = deepest = 0
    for token in _JSON_TOKEN.finditer(text):
        c = token.group()
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def read_json(root: Path, rel: str, limit: int = MAX_JSON_BYTES) -> Any:
    """Parse ``root/rel`` strictly (``parse_json``), opened under the path policy and refused over
    ``limit`` bytes before it is read."""
    try:
        data = read_bounded(root, rel, limit)
    except PathError as e:
        raise as_artifact(e) from None
    return parse_json(data, rel)


def sha256_file(path: Path, stop: threading.Event | None = None) -> str | None:
    """sha256 of a file a user named (a GGUF source, hashed in a thread beside its load; artifact files
    are hashed by ``check_files``); ``None`` once ``stop`` is set (the load failed and does not wait
    for the hash of a large file). Imports nothing (``qcompiler/interrupt.py``)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            if stop is not None and stop.is_set():
                return None
            digest.update(chunk)
    return digest.hexdigest()


def hash_open(fh: BinaryIO) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    for chunk in iter(lambda: fh.read(1 << 20), b""):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


MAX_GRAPH_BYTES = 256 * 2**20
"""Largest ``graph.qir`` a reader parses."""


def read_graph(root: Path) -> Module:
    """The artifact's ``graph.qir``, size-bounded, parsed and verified with every tensor's bytes read
    from the container (sha256 and code ranges checked): the ``graph`` gate every backend shares."""
    from qcompiler.ir.parser import parse_module
    from qcompiler.ir.verifier import verify_module

    try:
        data = read_bounded(root, GRAPH, MAX_GRAPH_BYTES)
        text = data.decode("utf-8")
    except PathError as e:
        raise as_artifact(e) from None
    except UnicodeDecodeError as e:
        raise ArtifactError(f"not UTF-8 ({e.reason} at byte {e.start})", file=GRAPH) from None
    try:
        m = parse_module(text, GRAPH)
        m.base_dir = str(root)
        verify_module(m, data=True)
    except ParseError as e:
        raise ArtifactError(e.message, file=str(e.loc)) from None
    except VerifyError as e:
        where = str(e.loc) if e.loc is not None else GRAPH
        raise ArtifactError(e.render().removeprefix(f"{e.loc}: ").removeprefix("error: "), file=where) from None
    except (QcError, OSError) as e:
        raise ArtifactError(str(e), file=GRAPH) from None
    return m


def check_files(root: Path, manifest: dict[str, Any], hashed: dict[str, str] | None = None) -> None:
    """Gate ``files``: the manifest's file list against the directory, sizes and hashes. ``hashed``:
    the sha256 of each file as its writer computed it while writing (the writer's last check before
    publishing compares with those instead of reading every byte again)."""
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
    expected_files: dict[str, tuple[int, str]] = {}
    for i, entry in enumerate(listed):
        field = f"files[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"path", "size", "sha256"}:
            raise ArtifactError(
                "malformed entry", file=MANIFEST, field=field, expected="{path, size, sha256}", found=entry
            )
        rel, size, digest = entry["path"], entry["size"], entry["sha256"]
        if not _safe_rel(rel) or rel in (MANIFEST, SIGNATURE) or rel in seen:
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
        expected_files[rel] = (size, digest)
    present = tree(root)
    for extra in sorted(set(present) - seen):
        raise ArtifactError("file is not listed in the manifest", file=extra)
    for rel, (size, digest) in expected_files.items():
        st = present.get(rel)
        if st is None:
            raise ArtifactError("listed in the manifest but missing", file=rel)
        if st.st_size != size:
            raise ArtifactError(
                "size differs from the manifest", file=rel, field="size", expected=size, found=st.st_size
            )
        if hashed is not None:
            found = hashed.get(rel, "not written by this writer")
        else:
            try:
                fh, _ = open_in(root, rel, expect=Identity.of(st))
            except PathError as e:
                raise as_artifact(e) from None
            with fh:
                _, found = hash_open(fh)
        if found != digest:
            raise ArtifactError(
                "content differs from the manifest", file=rel, field="sha256", expected=digest, found=found
            )


def tree(root: Path) -> dict[str, os.stat_result]:
    """Every file of the artifact but its manifest and signature, under the artifact path policy (no
    links of any kind, no hard links, no special files)."""
    try:
        files = walk(root, ARTIFACT)
    except PathError as e:
        raise as_artifact(e) from None
    for name in (MANIFEST, SIGNATURE):
        files.pop(name, None)
    return files


def _safe_rel(rel: object) -> bool:
    try:
        check_rel(rel)
    except PathError:
        return False
    return True


def read_manifest(root: Path) -> dict[str, Any]:
    if not root.is_dir():
        raise ArtifactError("not an artifact directory", file=str(root))
    manifest = read_json(root, MANIFEST)
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
    if isinstance(schema, bool) or not isinstance(schema, int) or schema not in manifest_schema.DECODE_FIELDS:
        raise ArtifactError(
            "unknown artifact schema",
            file=MANIFEST,
            field="versions.artifact_schema",
            expected=" or ".join(str(v) for v in manifest_schema.DECODE_FIELDS),
            found=schema,
        )
    try:
        manifest_schema.check(manifest, manifest_schema.schema(schema))
    except manifest_schema.SchemaError as e:
        raise as_artifact(e) from None
    return manifest


def check_written(root: Path, hashed: dict[str, str]) -> dict[str, Any]:
    """The publish-time gate after the one reopen: the manifest through every manifest gate, and the
    directory holding exactly the files it lists, of the listed sizes, with the hashes computed
    while they were written."""
    manifest = read_manifest(root)
    check_files(root, manifest, hashed)
    return manifest


def open_artifact(path: Path | str) -> OpenedArtifact:
    """Open a published artifact through every gate (see the module docstring)."""
    from qcompiler.artifact.derived import check_derived
    from qcompiler.backends import get_backend, targets

    root = Path(path)
    manifest = read_manifest(root)
    target = manifest.get("target")
    if target not in targets():
        raise ArtifactError(
            "unknown target", file=MANIFEST, field="target", expected=" | ".join(targets()), found=target
        )
    check_files(root, manifest)
    opened = get_backend(str(target)).open(root, manifest)
    check_derived(root, manifest, opened, get_backend(str(target)))
    opened.gates[:0] = ["manifest", "files"]
    opened.gates.append("derived")
    return opened

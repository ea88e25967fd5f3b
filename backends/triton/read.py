"""The triton backend's reader gates, in order; each failure names the file, kernel or tensor, and field.

1. ``container``: ``model.safetensors`` opens through the strict safetensors reader;
2. ``kernels``: ``kernels/index.json`` parses within its bound; every entry names a ``kind`` of
   ``kinds.KINDS`` and its key is a valid key of that kind (``KernelKey``, ``MixKey``) whose id is the
   entry's id; its source file is ``kernels/<id>.py`` and **equals, byte for byte, what the kind's
   codegen writes for the key** (so the runtime never needs to run text it read:
   it runs its own regenerated source), and its ``sha256`` is that source's; launch configuration,
   parameters and ``min_capability`` agree; ``aot`` is absent or ``{triton, targets: {sm_XY:
   {function: {...}}}}``; an entry or the index holds no other field; no other file lives under
   ``kernels/``;
3. ``graph``: ``graph.qir`` parses and verifies with its tensors read from ``model.safetensors``
   (each header entry's dtype and shape the declared ones), and the kernels it needs (key by key, with
   the weights using each) are exactly the index's; then the graph binds the rest: every tensor of
   ``model.safetensors`` is one ``graph.qir`` references, its ``__metadata__`` is the writer's, and
   what no codegen can re-derive (the index's ``triton`` version, ``targets`` and each kernel's AOT
   evidence) has the sha256 ``graph.qir``'s ``bound.kernels`` record holds.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from qcompiler.artifact.reader import ArtifactError, as_artifact, read_graph, read_json
from qcompiler.artifact.request import ContainerEntry, OpenedArtifact
from qcompiler.backends.safetensors import blobs as st_blobs
from qcompiler.backends.triton.codegen import CODEGEN_VERSION, source_sha256
from qcompiler.backends.triton.kinds import KINDS, KernelKind
from qcompiler.backends.triton.plan import INDEX_FILE, KERNEL_DIR, MODEL_FILE, module_kernels
from qcompiler.backends.triton.runtime import MIN_CAPABILITY
from qcompiler.errors import FileError, QcError
from qcompiler.ir.core import Module
from qcompiler.ir.facts import check_recorded, digest

ENTRY_FIELDS = ("id", "kind", "key", "source", "sha256", "functions", "admission", "weights", "min_capability", "aot")
INDEX_FIELDS = ("codegen_version", "triton", "targets", "kernels")
RECORD = "kernels"
"""The section of ``graph.qir``'s ``bound`` record for what the index holds that no codegen re-derives."""


def check_aot(aot: object, where: str) -> list[str]:
    """An entry's AOT evidence: ``None`` or ``{triton, targets: {sm_XY: {function: {field: value}}}}``;
    returns the target names."""
    if aot is None:
        return []
    if isinstance(aot, dict) and sorted(aot) == ["targets", "triton"] and isinstance(aot["triton"], str):  # pyright: ignore
        targets: object = aot["targets"]
        if isinstance(targets, dict) and all(
            isinstance(name, str)
            and name.startswith("sm_")
            and isinstance(fns, dict)
            and all(isinstance(x, dict) for x in fns.values())  # pyright: ignore[reportUnknownVariableType]
            for name, fns in targets.items()  # pyright: ignore[reportUnknownVariableType]
        ):
            return sorted(str(name) for name in targets)  # pyright: ignore[reportUnknownVariableType]
    raise ArtifactError(
        "AOT evidence must be null or {triton, targets: {sm_XY: {function: {...}}}}",
        file=INDEX_FILE,
        field=f"{where}.aot",
        found=sorted(aot) if isinstance(aot, dict) else type(aot).__name__,  # pyright: ignore
    )


def evidence_digests(index: dict[str, Any]) -> dict[str, str]:
    """What the index holds that no codegen re-derives -> its sha256 (the ``kernels`` record section)."""
    out = {"triton": digest(index.get("triton")), "targets": digest(index.get("targets"))}
    for entry in index.get("kernels") or []:
        out[f"{entry.get('id')}.aot"] = digest(entry.get("aot"))
    return out


def aot_targets(root: Path) -> dict[str, list[str]]:
    """Kernel id -> the targets its AOT evidence names, from the checked index (``check_kernels``)."""
    index = read_json(root, INDEX_FILE)
    check_kernels(root)
    return {e["id"]: check_aot(e.get("aot"), f"kernels[{i}]") for i, e in enumerate(index["kernels"])}


def same(found: object, want: object) -> bool:
    """JSON values equal as JSON, types included (``3.0`` is not ``3``, ``true`` is not ``1``)."""
    return json.dumps(found, sort_keys=True) == json.dumps(want, sort_keys=True)


def parse_kind(raw: object, where: str) -> KernelKind:
    if not isinstance(raw, str) or raw not in KINDS:
        raise ArtifactError(
            "unknown kernel kind", file=INDEX_FILE, field=f"{where}.kind", expected=sorted(KINDS), found=raw
        )
    return KINDS[raw]


def parse_key(kind: KernelKind, raw: object, where: str) -> Any:
    """A key of ``kind`` from its JSON: exactly the kind's fields (optional ones only when set), each of
    its type and allowed values, integers in ``[0, 2^20]``."""
    optional = kind.optional
    fields = [f.name for f in dataclasses.fields(kind.key_type) if f.name not in optional]
    if not isinstance(raw, dict) or sorted(set(raw) - set(optional)) != sorted(fields):
        found = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        expected = [*fields, *(f"[{o}]" for o in optional)]
        raise ArtifactError("kernel key fields", file=INDEX_FILE, field=f"{where}.key", expected=expected, found=found)
    rules = kind.rules | {k: v for k, v in optional.items() if k in raw}
    for name, (typ, allowed) in rules.items():
        value = raw[name]
        bad = type(value) is not typ or (allowed is not None and value not in allowed)
        if bad or (typ is int and (value < 0 or value > 1 << 20)):
            raise ArtifactError(
                "invalid key value",
                file=INDEX_FILE,
                field=f"{where}.key.{name}",
                expected=allowed or typ.__name__,
                found=value,
            )
    return kind.key_type(**raw)


def regenerate(kind: KernelKind, key: Any, where: str) -> str:
    try:
        return kind.generate(key)
    except ValueError as e:
        raise ArtifactError(f"no {kind.name} kernel for this key: {e}", file=INDEX_FILE, field=f"{where}.key") from None


def check_entry(root: Path, i: int, entry: object) -> tuple[Any, list[str]]:
    where = f"kernels[{i}]"
    if not isinstance(entry, dict):
        raise ArtifactError("must be an object", file=INDEX_FILE, field=where, found=type(entry).__name__)
    kind = parse_kind(entry.get("kind"), where)
    key = parse_key(kind, entry.get("key"), where)
    if not same(entry.get("id"), key.id):
        raise ArtifactError(
            "id is not its key's id", file=INDEX_FILE, field=f"{where}.id", expected=key.id, found=entry.get("id")
        )
    rel = f"{KERNEL_DIR}/{key.id}.py"
    if entry.get("source") != rel:
        raise ArtifactError(
            "source file name", file=INDEX_FILE, field=f"{where}.source", expected=rel, found=entry.get("source")
        )
    path = root / rel
    if path.is_symlink() or not path.is_file():
        raise ArtifactError("missing or not a regular file", file=rel)
    source = regenerate(kind, key, where)
    if path.read_bytes() != source.encode():
        raise ArtifactError(
            f"is not the source codegen v{kind.version} writes for {kind.name} key {key.id}; "
            "the runtime will not run it",
            file=rel,
            field="source",
            expected=f"{len(source.encode())} bytes of generated source",
            found=f"{path.stat().st_size} bytes that differ",
        )
    for field, want in (("sha256", source_sha256(source)), ("min_capability", MIN_CAPABILITY)):
        if not same(entry.get(field), want):
            raise ArtifactError(
                f"{field} disagrees with the codegen",
                file=INDEX_FILE,
                field=f"{where}.{field}",
                expected=want,
                found=entry.get(field),
            )
    extra = sorted(set(entry) - set(ENTRY_FIELDS))
    if extra:
        raise ArtifactError("unknown fields", file=INDEX_FILE, field=where, expected=list(ENTRY_FIELDS), found=extra)
    check_aot(entry.get("aot"), where)
    if not same(entry.get("functions"), kind.functions(key)):
        raise ArtifactError(
            "functions and launch configuration disagree with the codegen",
            file=INDEX_FILE,
            field=f"{where}.functions",
            expected=kind.functions(key),
            found=entry.get("functions"),
        )
    if not same(entry.get("admission"), kind.admission(key)):
        raise ArtifactError(
            "admission signature disagrees with the key",
            file=INDEX_FILE,
            field=f"{where}.admission",
            expected=kind.admission(key),
            found=entry.get("admission"),
        )
    weights = entry.get("weights")
    if not isinstance(weights, list) or not all(isinstance(w, str) for w in weights):
        raise ArtifactError("must be a list of weight names", file=INDEX_FILE, field=f"{where}.weights", found=weights)
    return key, weights


def check_kernels(root: Path) -> dict[Any, list[str]]:
    index = read_json(root, INDEX_FILE)
    if not isinstance(index, dict) or not same(index.get("codegen_version"), CODEGEN_VERSION):
        found = index.get("codegen_version") if isinstance(index, dict) else type(index).__name__
        raise ArtifactError(
            "codegen version", file=INDEX_FILE, field="codegen_version", expected=CODEGEN_VERSION, found=found
        )
    kernels = index.get("kernels")
    if sorted(index) != sorted(INDEX_FIELDS):
        raise ArtifactError("index fields", file=INDEX_FILE, expected=list(INDEX_FIELDS), found=sorted(index))
    if not isinstance(kernels, list):
        raise ArtifactError("must be a list", file=INDEX_FILE, field="kernels", found=type(kernels).__name__)
    keys = dict(check_entry(root, i, e) for i, e in enumerate(kernels))
    if len(keys) != len(kernels):
        raise ArtifactError("a kernel key is listed twice", file=INDEX_FILE, field="kernels")
    listed = {f"{KERNEL_DIR}/{k.id}.py" for k in keys} | {INDEX_FILE}
    present = {p.relative_to(root).as_posix() for p in (root / KERNEL_DIR).rglob("*") if not p.is_dir()}
    for extra in sorted(present - listed):
        raise ArtifactError("file under kernels/ that the index does not list", file=extra)
    return keys


def check_binding(root: Path, m: Module) -> None:
    """Gate ``graph``, second half: ``model.safetensors`` and the index's evidence are bound by ``m``."""
    st_blobs.check_bound(MODEL_FILE, st_blobs.opened_checked(root, MODEL_FILE), m)
    try:
        check_recorded(m, RECORD, evidence_digests(read_json(root, INDEX_FILE)), file=INDEX_FILE)
    except FileError as e:
        raise as_artifact(e) from None


def open_triton(root: Path, manifest: dict[str, Any] | None) -> OpenedArtifact:
    try:
        st = st_blobs.opened(root, MODEL_FILE)
    except ArtifactError:
        raise
    except QcError as e:
        raise ArtifactError(str(e), file=MODEL_FILE) from None
    keys = check_kernels(root)
    module = read_graph(root)
    needed = module_kernels(module)
    if needed != keys:
        missing = sorted(k.id for k in needed if k not in keys)
        extra = sorted(k.id for k in keys if k not in needed)
        raise ArtifactError(
            "the graph's kernels and the index differ" if not missing and not extra else "kernels missing or unused",
            file=INDEX_FILE,
            field="kernels",
            expected=f"graph needs {sorted(k.id for k in needed)}",
            found=f"missing {missing}, unused {extra}" if missing or extra else "other weights per kernel",
        )
    check_binding(root, module)
    entries = [ContainerEntry(e.name, MODEL_FILE, e.dtype, e.shape, e.end - e.begin) for e in st.tensors.values()]
    target = str((manifest or {}).get("target", "triton"))
    files = {MODEL_FILE, INDEX_FILE, "graph.qir", *(f"{KERNEL_DIR}/{k.id}.py" for k in keys)}
    return OpenedArtifact(root, target, manifest, module, entries, ["container", "kernels", "graph"], files=files)

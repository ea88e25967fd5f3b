"""One fuzz case of ``bench/fuzz.py``, end to end: copy the base artifact, apply the case's mutation,
rehash the manifest (or not), run ``verify_artifact(level=3)`` and, if it accepts, ``load``; then
classify the outcome. A consumer view (``view``) tells an accepted change from an accepted no-op.

Outcomes: ``typed`` (a ``QcError`` or verify's ``ok=false``), ``accepted-unchanged``,
``accepted-changed`` (accepted corruption), ``untyped`` (any other exception escaped), ``hang`` and
``memory`` (set by the pool), ``fuzzer-error`` (a mutator failed: a bug of the fuzzer, not of qcompiler).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import stat
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fuzz_files import bytes_mutator, file_mutator, kernel_source_mutator
from fuzz_formats import gguf_kv_mutator, gguf_tensor_mutator, onnx_mutator, st_mutator
from fuzz_mutators import MANIFEST, Ctx, Mutation, Mutator, clip, json_mutator, manifest_mutator
from fuzz_qir import qir_mutator
from fuzz_view import behaviour, diff, same_behaviour, view

REPO = Path(__file__).resolve().parents[1]
OURS = ("qcompiler/", "passes/", "backends/")
REHASHED_SHARE = 0.85

MUTATORS: dict[str, Mutator] = {
    "manifest": manifest_mutator,
    "json": json_mutator,
    "qir": qir_mutator,
    "bytes": bytes_mutator,
    "file": file_mutator,
    "st-header": st_mutator,
    "gguf-kv": gguf_kv_mutator,
    "gguf-tensor": gguf_tensor_mutator,
    "onnx": onnx_mutator,
    "kernel-src": kernel_source_mutator,
}
FAMILIES: dict[str, dict[str, int]] = {
    "safetensors": {"manifest": 3, "json": 3, "qir": 4, "bytes": 2, "file": 2, "st-header": 5},
    "gguf": {"manifest": 3, "qir": 4, "bytes": 2, "file": 2, "gguf-kv": 4, "gguf-tensor": 4, "st-header": 1},
    "onnx": {"manifest": 3, "qir": 4, "bytes": 2, "file": 2, "onnx": 8},
    "triton": {"manifest": 3, "json": 4, "qir": 4, "bytes": 2, "file": 2, "st-header": 4, "kernel-src": 1},
}
"""Mutator families of each target with their weights (cases per cycle of the schedule)."""


@dataclass
class Result:
    target: str
    seed: int
    index: int
    mode: str = ""
    family: str = ""
    file: str = ""
    where: str = ""
    mutation: str = ""
    outcome: str = ""
    stage: str = ""
    error: str = ""
    exc_type: str = ""
    inner: str = ""
    outer: str = ""
    changed: str = ""
    traceback: str = ""
    seconds: float = 0.0
    digest: str = ""
    reused: int = -1
    """The earlier case (index) whose identical tree gave this case's outcome; -1: evaluated."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def schedule(target: str) -> list[str]:
    """The cyclic family schedule: every family once first, then the rest of the weights."""
    weights = FAMILIES[target]
    extra = [f for f, w in weights.items() for _ in range(w - 1)]
    random.Random(target).shuffle(extra)
    return list(weights) + extra


def rng_of(target: str, seed: int, index: int) -> random.Random:
    return random.Random(f"{target}:{seed}:{index}")


def build_case(target: str, seed: int, index: int, base: Path, work: Path) -> tuple[Path, str, Mutation]:
    """Lay out case ``index`` of ``seed`` under ``work`` (``artifact/`` and ``outside/``); returns
    the artifact, the manifest mode and the mutation. Reproducible from its arguments alone."""
    rng = rng_of(target, seed, index)
    mode = "rehashed" if rng.random() < REHASHED_SHARE else "plain"
    plan = schedule(target)
    family = plan[index % len(plan)]
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    root = work / "artifact"
    shutil.copytree(base, root, symlinks=True)
    mutation = MUTATORS[family](Ctx(root, work / "outside", rng, target, rehash=mode == "rehashed"))
    if mode == "rehashed" and not mutation.manifest and (root / MANIFEST).is_file():
        rehash(root)
    return root, mode, mutation


def rehash(root: Path) -> None:
    """What a careless tool (or an attacker) does after editing: list every file it can read with its
    size and sha256, and recompute ``self_sha256``; nothing else in the manifest changes. (A manifest
    edit recomputes ``self_sha256`` itself: ``fuzz_mutators.with_digest``.)"""
    from qcompiler.artifact.writer import SELF_DIGEST, manifest_digest

    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (ValueError, UnicodeDecodeError, RecursionError):
        return
    if not isinstance(manifest, dict):
        return
    listed: list[dict[str, Any]] = []
    for dirpath, _, names in os.walk(root, followlinks=True):
        for name in sorted(names):
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if rel in (MANIFEST, "manifest.sig") or not p.is_file():
                continue
            data = p.read_bytes()
            listed.append({"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest["files"] = sorted(listed, key=lambda e: str(e["path"]))
    try:
        manifest[SELF_DIGEST] = manifest_digest(manifest)  # pyright: ignore[reportUnknownArgumentType]
        (root / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    except (TypeError, ValueError, UnicodeEncodeError, RecursionError):
        return


BASE_BEHAVIOUR: dict[str, Any] = {}


def base_behaviour(base: Path) -> Any:
    """``behaviour`` of a base artifact, computed once per process."""
    key = str(base)
    if key not in BASE_BEHAVIOUR:
        BASE_BEHAVIOUR[key] = behaviour(base)
    return BASE_BEHAVIOUR[key]


def evaluate(root: Path, result: Result, base_view: dict[str, str], base: Path) -> None:
    """Run the readers on the mutated artifact and fill ``result``'s outcome."""
    from qcompiler.errors import QcError
    from qcompiler.report import verify_artifact
    from qcompiler.runtime import load

    result.stage = "verify"
    try:
        report = verify_artifact(root, level=3)
        if not report["ok"]:
            result.outcome, result.error = "typed", clip(str(report.get("error", "")), 300)
            return
        result.stage = "load"
        load(root)
    except QcError as e:
        result.outcome, result.exc_type, result.error = "typed", type(e).__name__, clip(str(e), 300)
        return
    except Exception as e:
        result.outcome, result.exc_type, result.error = "untyped", type(e).__name__, clip(str(e), 300)
        result.inner, result.outer = frames(e)
        result.traceback = "".join(traceback.format_exception(e))
        return
    result.stage = "accepted"
    changed = diff(base_view, view(root))
    if changed == ["graph.qir"] and same_behaviour(base_behaviour(base), behaviour(root)):
        changed = []  # graph.qir's one consumer, qcompiler, computes the same (within float32 noise)
    result.outcome = "accepted-changed" if changed else "accepted-unchanged"
    result.changed = ", ".join(changed)


def run_case(
    target: str,
    seed: int,
    index: int,
    base: Path,
    work: Path,
    base_view: dict[str, str],
    built: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
) -> Result:
    """Build and evaluate one case. ``built`` hears the case's description (with ``digest``, the
    mutated tree's) before the readers run, and may answer with the result of an earlier case that
    left the same tree: the readers are deterministic, so its outcome is reused."""
    t0 = time.perf_counter()
    result = Result(target, seed, index)
    try:
        root, result.mode, m = build_case(target, seed, index, base, work)
    except Exception as e:
        result.outcome, result.exc_type, result.error = "fuzzer-error", type(e).__name__, clip(str(e), 300)
        result.traceback = "".join(traceback.format_exception(e))[-6000:]
        return result
    result.family, result.file, result.where, result.mutation = m.family, m.file, m.where, m.detail
    if built is not None:
        result.digest = tree_digest(root.parent)
        earlier = built(result.as_dict())
        if earlier is not None:
            for key in REUSED:
                setattr(result, key, earlier.get(key, ""))
            result.reused = int(earlier["index"])
            result.seconds = time.perf_counter() - t0
            return result
    evaluate(root, result, base_view, base)
    result.seconds = time.perf_counter() - t0
    return result


REUSED = ("outcome", "stage", "error", "exc_type", "inner", "outer", "changed", "traceback")
"""What a case takes over from an earlier case with the same tree."""


def tree_digest(work: Path) -> str:
    """sha256 over a case folder: every path, its type, link count, link target and bytes."""
    h = hashlib.sha256()
    for dirpath, dirnames, names in os.walk(work):
        dirnames.sort()
        for name in sorted(names + dirnames):
            p = Path(dirpath) / name
            st = os.lstat(p)
            h.update(f"{p.relative_to(work).as_posix()}\0{st.st_mode}\0{st.st_nlink}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(p).encode())
            elif stat.S_ISREG(st.st_mode):
                h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def frames(e: BaseException) -> tuple[str, str]:
    """The innermost and outermost frames in qcompiler, passes or backends code, as ``file:line``."""
    ours: list[str] = []
    for f in traceback.extract_tb(e.__traceback__):
        rel = repo_path(f.filename)
        if rel.startswith(OURS):
            ours.append(f"{rel}:{f.lineno}")
    return (ours[-1], ours[0]) if ours else ("", "")


def repo_path(filename: str) -> str:
    real = os.path.realpath(filename)
    try:
        return Path(real).relative_to(REPO).as_posix()
    except ValueError:
        return filename

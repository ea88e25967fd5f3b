"""Format-agnostic mutators of ``bench/fuzz.py``: JSON documents, ``graph.qir`` tokens and lines, raw
bytes, and whole files (delete, add, links, special files).

Each mutator takes a ``Ctx`` (the artifact copy, a folder outside it, the case's seeded RNG) and
returns a ``Mutation`` saying what it changed: ``where`` is a coarse class (the report groups by it),
``detail`` the concrete change. The container-format mutators are in ``fuzz_formats.py``.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

MANIFEST = "manifest.json"


@dataclass
class Ctx:
    """One case's working state: ``root`` is the artifact copy, ``outside`` a folder next to it."""

    root: Path
    outside: Path
    rng: random.Random
    target: str
    rehash: bool = False
    """The case rehashes the manifest: a manifest edit then recomputes ``self_sha256`` itself."""


@dataclass
class Mutation:
    """What a mutator did. ``manifest``: it edited ``manifest.json`` (applied after a rehash)."""

    family: str
    file: str
    where: str
    detail: str
    manifest: bool = False


Mutator = Callable[[Ctx], Mutation]


def files_of(root: Path) -> list[str]:
    """Every regular file under ``root`` (relative, sorted), links not followed."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink():
                out.append(p.relative_to(root).as_posix())
    return sorted(out)


def write_text(path: Path, text: str) -> None:
    """Write ``text`` as UTF-8, lone surrogates included as their (invalid) 3-byte forms."""
    path.write_bytes(text.encode("utf-8", "surrogatepass"))


def clip(text: str, limit: int = 90) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------- values

HUGE_INTS = [2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1, -(2**63) - 1, 10**30]
SMALL_INTS = [0, 1, -1, 2, 3, 7, 8, 16, 31, 33, 64, 65, 255, 256, 4096]
WEIRD_STRINGS = [
    "",
    "NaN",
    "Infinity",
    "-0",
    "0x10",
    "1e400",
    "\u202eevil",
    "e\u0301",
    "\u00e9",
    "\x00",
    "\ud800",
    "../../etc/passwd",
    "/etc/passwd",
    "model.safetensors",
    "graph.qir",
    "x" * 70_000,
    "🙂" * 10,
]


class Raw:
    """A JSON token written as is (``NaN``, a 5,000-digit number, ``[[[...]]]`` nested 100,000 deep)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return clip(self.text, 40)


class Dup:
    """A JSON object written with one key twice: ``pairs`` in order."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        self.pairs = pairs


def interesting(rng: random.Random, old: object) -> object:
    """A replacement value: same type but extreme, another type, or a raw token."""
    choices: list[Callable[[], object]] = [
        lambda: rng.choice(SMALL_INTS),
        lambda: rng.choice(HUGE_INTS),
        lambda: Raw("1" + "0" * rng.choice([400, 5000])),
        lambda: Raw(rng.choice(["NaN", "Infinity", "-Infinity", "1e400", "-0.0", "1.0e-400"])),
        lambda: rng.choice([0.5, -1.5, 1e308, 1.0]),
        lambda: rng.choice([True, False, None]),
        lambda: rng.choice(WEIRD_STRINGS),
        lambda: [],
        lambda: {},
        lambda: [old],
        lambda: {"value": old},
        lambda: str(old),
        lambda: deep(rng),
    ]
    if isinstance(old, bool):
        choices.append(lambda: not old)
        choices.append(lambda: int(old))
    elif isinstance(old, int):
        choices += [lambda: old + rng.choice([-1, 1]), lambda: -old, lambda: float(old), lambda: old * 2]
    elif isinstance(old, float):
        choices += [lambda: old * rng.choice([-1.0, 2.0, 1.0000001]), lambda: int(old)]
    elif isinstance(old, str):
        choices += [lambda: old + "x", lambda: old.upper(), lambda: old[:-1], lambda: old + "\u0000", lambda: " " + old]
    elif isinstance(old, list) and old:
        seq = cast(list[Any], old)
        choices += [lambda: seq[:-1], lambda: [*seq, seq[0]], lambda: seq[::-1], lambda: seq * 2]
    return rng.choice(choices)()


def deep(rng: random.Random) -> Raw:
    n = rng.choice([63, 65, 1000, 100_000])
    return Raw("[" * n + "1" + "]" * n)


def dump(value: object, indent: int = 0) -> str:
    """JSON text like ``json.dumps(indent=2, sort_keys=True)``, plus ``Raw`` tokens and ``Dup`` objects."""
    pad, inner = " " * indent, " " * (indent + 2)
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Dup | dict):
        pairs = value.pairs if isinstance(value, Dup) else sorted(value.items(), key=lambda kv: str(kv[0]))  # pyright: ignore[reportUnknownLambdaType]
        if not pairs:
            return "{}"
        body = ",\n".join(f"{inner}{json.dumps(str(k))}: {dump(v, indent + 2)}" for k, v in pairs)
        return "{\n" + body + "\n" + pad + "}"
    if isinstance(value, list):
        if not value:
            return "[]"
        return "[\n" + ",\n".join(inner + dump(v, indent + 2) for v in value) + "\n" + pad + "]"  # pyright: ignore[reportUnknownVariableType]
    if isinstance(value, float) and value != value:
        return "NaN"
    return json.dumps(value)


def nodes(doc: object, path: tuple[str | int, ...] = (), limit: int = 8) -> list[tuple[str | int, ...]]:
    """Paths to every value in ``doc`` (depth-limited), the root excluded."""
    out: list[tuple[str | int, ...]] = []
    if len(path) >= limit:
        return out
    if isinstance(doc, dict):
        for k, v in doc.items():  # pyright: ignore[reportUnknownVariableType]
            out.append((*path, str(k)))
            out += nodes(v, (*path, str(k)), limit)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
            out.append((*path, i))
            out += nodes(v, (*path, i), limit)
    return out


def get(doc: Any, path: tuple[str | int, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def show_path(path: tuple[str | int, ...], generic: bool = False) -> str:
    """``versions.packing_layout[0]``; ``generic``: indices as ``[*]`` and tensor-like keys as ``<name>``."""
    text = ""
    for p in path:
        if isinstance(p, int):
            text += "[*]" if generic else f"[{p}]"
        else:
            key = "<name>" if generic and ("." in p or "/" in p) else p
            text += ("." if text else "") + key
    return text or "<root>"


def mutate_json(doc: Any, rng: random.Random, paths: list[tuple[str | int, ...]]) -> tuple[Any, str, str]:
    """One edit of a parsed JSON document at one of ``paths``; returns (new doc, where, detail)."""
    path: tuple[str | int, ...] = rng.choice(paths) if paths else ()
    op = rng.choice(["set", "set", "set", "delete", "add", "dup", "nest"]) if path else rng.choice(["add", "set"])
    where = show_path(path, generic=True)
    if not path and op == "set":
        new = interesting(rng, doc)
        return new, "<root>", f"root -> {clip(repr(new), 60)}"
    parent = get(doc, path[:-1]) if path else doc
    key = path[-1] if path else None
    if op == "set" and key is not None:
        new = interesting(rng, parent[key])
        old = clip(repr(parent[key]), 40)
        parent[key] = new
        return doc, where, f"{show_path(path)}: {old} -> {clip(repr(new), 60)}"
    if op == "delete" and key is not None:
        del parent[key]
        return doc, where, f"{show_path(path)} deleted"
    if op == "nest" and key is not None:
        parent[key] = deep(rng)
        return doc, where, f"{show_path(path)} -> nested {len(parent[key].text) // 2} deep"
    holder = parent[key] if key is not None else doc
    if op == "dup" and isinstance(parent, dict) and key is not None:
        pairs = sorted(parent.items(), key=lambda kv: str(kv[0]))  # pyright: ignore[reportUnknownLambdaType]
        pairs.append((str(key), interesting(rng, parent[key])))
        if len(path) == 1:
            return Dup(pairs), where, f"{show_path(path)} key written twice"
        get(doc, path[:-2])[path[len(path) - 2]] = Dup(pairs)
        return doc, where, f"{show_path(path)} key written twice"
    if isinstance(holder, dict):
        name = rng.choice(["extra", "__proto__", "files", "self_sha256", "", "target", "\ud800"])
        holder[name] = interesting(rng, 1)
        return doc, where, f"{show_path(path[:-1] if key is None else path)}: key {name!r} added"
    if isinstance(holder, list):
        holder.append(interesting(rng, holder[0] if holder else 0))
        return doc, where, f"{show_path(path)}: element appended"
    if key is not None:
        parent[key] = interesting(rng, holder)
    return doc, where, f"{show_path(path)} replaced"


MANIFEST_SECTIONS = [
    "files",
    "files",
    "versions",
    "versions",
    "topology",
    "parity",
    "conversions",
    "target",
    "model",
    "tokenizer_sha256",
    "self_sha256",
    "rate_ledger",
    "provenance",
    "",
]


def manifest_mutator(ctx: Ctx) -> Mutation:
    """One edit of ``manifest.json``, biased to the sections readers interpret."""
    doc = json.loads((ctx.root / MANIFEST).read_text())
    section = ctx.rng.choice(MANIFEST_SECTIONS)
    if section and section not in doc:
        doc[section] = None
    paths: list[tuple[str | int, ...]] = [p for p in nodes(doc) if not section or p[0] == section]
    if section == "conversions" and not doc.get("conversions"):
        doc["conversions"] = [{"tensor": "model.layers.0.mlp.up_proj.weight", "convert": "dense", "reason": "fuzz"}]
        paths = [("conversions",), ("conversions", 0)]
    doc, where, detail = mutate_json(doc, ctx.rng, paths)
    if ctx.rehash and section != "self_sha256":
        doc = with_digest(doc)
    write_text(ctx.root / MANIFEST, dump(doc) + "\n")
    return Mutation("manifest", MANIFEST, where, detail, manifest=True)


def with_digest(doc: Any) -> Any:
    """``doc`` with ``self_sha256`` set to the digest a reader computes from its text (where it parses)."""
    from qcompiler.artifact.writer import SELF_DIGEST, manifest_digest

    try:
        parsed = json.loads(dump(doc))
        digest = manifest_digest(parsed) if isinstance(parsed, dict) else ""
    except (ValueError, RecursionError, TypeError):
        return doc
    if isinstance(doc, Dup):
        doc.pairs = [(k, digest if k == SELF_DIGEST else v) for k, v in doc.pairs]
    elif isinstance(doc, dict):
        doc[SELF_DIGEST] = digest
    return doc


def json_mutator(ctx: Ctx) -> Mutation:
    """One edit of a JSON file other than the manifest (``config.json``, ``kernels/index.json``)."""
    files = [f for f in files_of(ctx.root) if f.endswith(".json") and f != MANIFEST]
    rel = ctx.rng.choice(files)
    doc = json.loads((ctx.root / rel).read_text())
    doc, where, detail = mutate_json(doc, ctx.rng, nodes(doc))
    write_text(ctx.root / rel, dump(doc) + "\n")
    return Mutation("json", rel, where, detail)

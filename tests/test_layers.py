"""Layers point one way (docs/architecture.md): a module imports only from its own layer or below.

Every ``import``/``from`` statement of every module counts, at any depth of the file (a function-level
import is as much a dependency as a top-level one; so is one under ``TYPE_CHECKING``), and so does a
string naming a backend module (a lazy registry entry is an import by another name). ``KNOWN`` lists
the edges that still go the wrong way, each with the step that removes it: the list may only shrink
(a known edge that no longer exists fails too, so it is deleted with its fix).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "qcompiler": ROOT / "qcompiler",
    "qcompiler.passes": ROOT / "passes",
    "qcompiler.backends": ROOT / "backends",
}

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("errors", "env", "heap", "interrupt", "parallel", "paths", "plugins", "version")),
    ("ir", ("ir",)),
    ("quant", ("quant",)),
    ("evidence", ("decode_digest", "parity", "parity_rows", "proofs", "ladder")),
    ("artifact", ("artifact", "backends", "backends.base")),
    ("frontend", ("frontend",)),
    ("runtime", ("runtime",)),
    ("report", ("report",)),
    ("passes and backends", ("passes", "backends.*")),
    ("top", ("", "api", "cli", "testing", "examples")),
]
"""Bottom to top, by module under ``qcompiler.``: ``x`` is the module or package ``x`` and everything
in it, ``backends.*`` every backend package (the registry, ``backends`` and ``backends.base``, sits
with the artifact layer that dispatches through it), ``""`` the package root (the public facade)."""

KNOWN: dict[tuple[str, str], str] = {}

REGISTRY = "qcompiler.backends"
"""The one module whose strings name backends by design: each backend's registration row."""

BACKEND_STRING = re.compile(r"^(qcompiler\.backends\.[a-z_]+(?:\.[a-z_]+)*)(?::\w+)?$")


def layer(module: str) -> int:
    """The index in ``LAYERS`` of ``module`` (a dotted name under ``qcompiler``)."""
    rel = module.removeprefix("qcompiler").removeprefix(".")
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if p == "backends.*":
                hit, size = rel.startswith("backends.") and rel != "backends.base", len("backends.")
            else:
                hit, size = rel == p or (p != "" and rel.startswith(p + ".")), len(p)
            if hit and size > best_len:
                best, best_len = i, size
    assert best >= 0, f"{module} is in no layer: add it to LAYERS"
    return best


def modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for prefix, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if prefix == "qcompiler" and parts[0] in ("passes", "backends"):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


def imports(module: str, path: Path) -> set[str]:
    """Every ``qcompiler`` module ``path`` names in an import statement or a backend-module string."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base]) if base else ".".join(up)
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in ALL else base for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and module != REGISTRY:
            hit = BACKEND_STRING.match(node.value)
            if hit:
                found.add(hit.group(1))
    return {m for m in found if m == "qcompiler" or m.startswith("qcompiler.")}


ALL = modules()


def edges() -> set[tuple[str, str]]:
    return {(m, t) for m, path in ALL.items() for t in imports(m, path) if layer(t) > layer(m)}


def test_every_module_has_a_layer() -> None:
    for m in ALL:
        layer(m)


def test_layers_point_one_way() -> None:
    wrong = sorted(e for e in edges() if e not in KNOWN)
    assert not wrong, "imports from a lower layer into a higher one:\n" + "\n".join(
        f"  {a} ({LAYERS[layer(a)][0]}) -> {b} ({LAYERS[layer(b)][0]})" for a, b in wrong
    )


def test_known_exceptions_still_exist() -> None:
    gone = sorted(set(KNOWN) - edges())
    assert not gone, f"fixed, so delete from KNOWN: {gone}"


def test_the_checker_sees_each_kind_of_import(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "import qcompiler.cli\nfrom qcompiler.ir import types\n"
        "def f():\n    from qcompiler.backends.gguf import codecs\n"
        "T = {'x': 'qcompiler.backends.onnx.layouts:Thing'}\n"
    )
    found = imports("qcompiler.ir.m", src)
    want = {"qcompiler.cli", "qcompiler.ir.types", "qcompiler.backends.gguf.codecs", "qcompiler.backends.onnx.layouts"}
    assert want <= found
    assert layer("qcompiler.cli.main") > layer("qcompiler.backends.gguf.codecs") > layer("qcompiler.backends")
    assert layer("qcompiler.parity_rows") == layer("qcompiler.parity") > layer("qcompiler.ir.core")


def test_no_pass_imports_another_pass() -> None:
    """A pass reads what another recorded through ``ir.module_attrs``' accessors and shares helpers
    through ``passes.base`` or helper modules (``freeze_known``, ``conversions``), never by importing
    the other pass's module."""
    from qcompiler.passes import PASSES

    passes = {target.partition(":")[0] for target in PASSES.values()}
    wrong = sorted((m, t) for m in passes for t in imports(m, ALL[m]) if t in passes and t != m)
    assert not wrong, f"passes importing other passes: {wrong}"

"""Small files are a tested invariant: a pass file stays under ~150 lines (patterns go in a sibling
module), and no product module grows past 400 lines."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = sorted(p for d in ("qcompiler", "passes", "backends") for p in (ROOT / d).rglob("*.py"))
PASS_FILE_LIMIT = 150
MODULE_LIMIT = 400


@pytest.mark.parametrize("path", PRODUCT, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_small(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    limit = MODULE_LIMIT
    if path.parent.name == "passes" and path.stem not in ("__init__", "base", "spec", "manager"):
        limit = PASS_FILE_LIMIT
    assert lines <= limit, f"{path.relative_to(ROOT)} has {lines} lines (limit {limit}); split it"

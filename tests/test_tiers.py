"""The test tiers (``tests/conftest.py``): the fast table names only test files that exist, and every
collected test carries exactly one tier marker, so ``-m fast`` and ``-m peer`` split the suite."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TIERS = {"fast", "peer"}


def test_the_fast_table_names_only_existing_test_files(fast_files: frozenset[str]) -> None:
    files = {p.name for p in TESTS.glob("test_*.py")}
    assert fast_files <= files, f"the fast table names missing files: {sorted(fast_files - files)}"
    assert files - fast_files, "no file is left for the peer tier"


def test_every_collected_test_has_exactly_one_tier(request: pytest.FixtureRequest) -> None:
    for item in request.session.items:
        tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
        assert len(tiers) == 1, f"{item.nodeid}: tiers {sorted(tiers)}"


def test_the_tier_markers_are_registered(pytestconfig: pytest.Config) -> None:
    registered = {line.split(":")[0].strip() for line in pytestconfig.getini("markers")}
    assert registered >= TIERS

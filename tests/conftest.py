"""Shared fixtures."""

from __future__ import annotations

import pytest

from qcompiler.testing import Cli, run_cli


@pytest.fixture
def cli() -> Cli:
    """``cli("opt", "file.qir", stdin=...)`` runs the CLI in this process."""
    return run_cli

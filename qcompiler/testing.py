"""Helpers for tests of qcompiler and of its plugins: run the CLI in this process."""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass

from qcompiler.cli.main import main


@dataclass
class CliResult:
    code: int
    out: str
    err: str


Cli = Callable[..., CliResult]


def run_cli(*argv: str, stdin: str | None = None) -> CliResult:
    """Run ``qcompiler ARGV`` in this process, feeding ``stdin``, and capture its output."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdin
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as e:
                code = int(e.code or 0)
    finally:
        sys.stdin = saved
    return CliResult(code, out.getvalue(), err.getvalue())

"""Helpers for tests of qcompiler and of its plugins: run the CLI in this process; build small sources."""

from __future__ import annotations

import hashlib
import io
import json
import sys
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qcompiler.cli.main import main

if TYPE_CHECKING:
    from qcompiler.ir.core import Module


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
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode()), encoding="utf-8")
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as e:
                code = int(e.code or 0)
    finally:
        sys.stdin = saved
    return CliResult(code, out.getvalue(), err.getvalue())


def rehash(path: Path) -> None:
    """List every file under the artifact ``path`` (``kernels/`` included; not the manifest or its
    signature) in its manifest with size and sha256, and recompute ``self_sha256``: what a careless tool
    or an attacker does after editing a file, so only the reader's deeper gates can notice the edit."""
    from qcompiler.artifact.writer import MANIFEST, SELF_DIGEST, SIGNATURE, manifest_digest

    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"] = [
        {
            "path": p.relative_to(path).as_posix(),
            "size": p.stat().st_size,
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
        }
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.relative_to(path).as_posix() not in (MANIFEST, SIGNATURE)
    ]
    manifest[SELF_DIGEST] = manifest_digest(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def gptq_module(g_idx: np.ndarray, n: int, group: int, seed: int = 0) -> tuple[Module, np.ndarray]:
    """A module whose one weight ``w`` is GPTQ-style (act order): codes in original column order, the
    group of column k is ``g_idx[k]``; with the weight it stands for (``(codes - zero) * scale``)."""
    from qcompiler.ir.attrs import AttrValue
    from qcompiler.ir.builder import Builder
    from qcompiler.ir.core import Module
    from qcompiler.ir.dtypes import DTYPES
    from qcompiler.ir.types import DenseType
    from qcompiler.ir.verifier import verify_module

    rng = np.random.default_rng(seed)
    k = len(g_idx)
    codes = rng.integers(-8, 8, size=(n, k)).astype(np.int8)
    groups = int(g_idx.max()) + 1
    scale = (rng.random((n, groups)) * 0.1 + 0.01).astype(np.float32)
    zero = rng.integers(-2, 3, size=(n, groups)).astype(np.int8)
    effective = ((codes.astype(np.float32) - zero[:, g_idx]) * scale[:, g_idx]).astype(np.float32)
    b = Builder(Module("gptq", attrs={"invariants": [], "provenance": {"source": "test"}}))
    b.graph("forward", x=DenseType(DTYPES["f32"], ("?batch", k)))
    attrs: dict[str, AttrValue] = {
        "source": "gptq",
        "codes": b.tensor("w.codes", codes, "i8"),
        "scale": b.tensor("w.scale", scale, "f32"),
        "zero": b.tensor("w.zero", zero, "i8"),
        "g_idx": b.tensor("w.g_idx", g_idx.astype(np.int32), "i32"),
        "block": [1, group],
        "qmin": -8,
        "qmax": 7,
        "effective": b.tensor("w.effective", effective, "f32"),
    }
    w = b.op("q.source_weight", [], DenseType(DTYPES["f32"], (n, k)), attrs, out="w")
    assert b.current is not None
    y = b.op("linear", [b.current.args[0], w], DenseType(DTYPES["f32"], ("?batch", n)), out="y")
    b.ret(y)
    verify_module(b.module)
    return b.module, effective


def shuffled_act_order(k: int, group: int, seed: int = 0) -> np.ndarray:
    """A ``g_idx`` with ``k / group`` equal groups in shuffled column order."""
    return np.random.default_rng(seed).permutation(np.arange(k) // group)

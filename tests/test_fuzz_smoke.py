"""``bench/fuzz.py`` against the artifact readers: every mutator family runs on every target, a case
replays alone to the same outcome, and a seeded smoke run (2,000 cases per target, two workers)
finds no untyped exception, accepted corruption, hang or memory blow-up.

The smoke's case count can be lowered with ``QCOMPILER_FUZZ_CASES`` (e.g. while fixing a finding);
its failure message lists each distinct finding with a ``--replay`` id and its corpus folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "fuzz.py"
SMOKE_CASES = int(os.environ.get("QCOMPILER_FUZZ_CASES", "2000"))
MODEL = "fuzz_model:llama_1layer"
"""The one-layer tiny Llama (bench/fuzz_model.py): every tensor kind, half the graph of the default."""
FAMILY_CASES = 7
"""The largest number of mutator families of one target: the schedule runs each once first."""


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compiled base artifacts, shared by every run in this module (compiled by the first)."""
    return tmp_path_factory.mktemp("fuzz-bases")


def fuzz(*args: object, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def findings(data: dict[str, Any]) -> str:
    lines = [f"corpus: {data['corpus']}"]
    for d in data["distinct"]:
        what = f"{d['exc_type']} at {d['inner']}" if d["outcome"] == "untyped" else f"{d['file']}: {d['where']}"
        lines.append(f"{d['outcome']} x{d['count']}: {what}; --replay {d['example']}: [{d['mode']}] {d['mutation']}")
        lines.append(f"    {d['error'] or d['changed']}  ({d['corpus']})")
    return "\n".join(lines)


def test_every_mutator_family_runs_and_a_case_replays(bases: Path, tmp_path: Path) -> None:
    out = tmp_path / "families.json"
    args: tuple[object, ...] = ("--target", "all", "--cases", FAMILY_CASES, "--seed", 7, "--workers", 1)
    args += ("--bases", bases, "--model", MODEL)
    r = fuzz(*args, "--json", out, "--corpus", tmp_path / "corpus", timeout=900)
    assert out.is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    for target, row in data["targets"].items():
        assert set(row["families"]) == set(row["scheduled"]), target
        assert row["outcomes"]["fuzzer-error"] == 0, findings(data)
    case = data["targets"]["gguf"]["results"][3]
    replay = ("--replay", f"gguf:7:{case['index']}", "--bases", bases, "--model", MODEL)
    r = fuzz(*replay, "--corpus", tmp_path / "corpus", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in r.stdout.splitlines() if ": " in line)
    assert (lines["family"], lines["where"], lines["outcome"]) == (case["family"], case["where"], case["outcome"])
    assert (tmp_path / "corpus" / f"gguf-7-{case['index']}" / "case.json").is_file()


def test_fuzz_smoke(bases: Path, tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    args: tuple[object, ...] = ("--target", "all", "--cases", SMOKE_CASES, "--seed", 0, "--workers", 2)
    args += ("--bases", bases, "--model", MODEL)
    r = fuzz(*args, "--json", out, "--corpus", tmp_path / "corpus", timeout=3600)
    assert out.is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert all(row["cases"] == SMOKE_CASES for row in data["targets"].values())
    assert not data["distinct"], findings(data)

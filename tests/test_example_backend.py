"""Adding a backend is one folder plus one line: ``tests/example_backend/qc_npz/`` is a whole backend
(``--target npz``: the IR's tensors in one ``weights.npz``) kept outside qcompiler's tree, registered
by a single ``qcompiler.backends`` entry-point line. Put on the path, it compiles, publishes through
the shared writer and reader gates, and verifies; nothing in qcompiler names it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = Path(__file__).resolve().parent / "example_backend"
LLAMA = "qcompiler.examples:tiny_llama_hf"


def qcompiler(cwd: Path, *args: str, path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if path is not None:
        env["PYTHONPATH"] = str(path)
    cmd = [sys.executable, "-m", "qcompiler.cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_the_example_backend_is_one_folder_and_one_line() -> None:
    files = sorted(p.relative_to(EXAMPLE).as_posix() for p in EXAMPLE.rglob("*") if p.is_file())
    assert files == [
        "qc_npz-0.1.dist-info/METADATA",
        "qc_npz-0.1.dist-info/entry_points.txt",
        "qc_npz/__init__.py",
        "qc_npz/backend.py",
        "qc_npz/kernels.py",
        "qc_npz/layouts.py",
    ]
    lines = (EXAMPLE / "qc_npz-0.1.dist-info" / "entry_points.txt").read_text().split("\n")
    assert [line for line in lines if "=" in line] == ["npz = qc_npz"]  # the one line
    for folder in ("qcompiler", "passes", "backends"):
        for src in (ROOT / folder).rglob("*.py"):
            assert "qc_npz" not in src.read_text(), f"{src} names the example backend"


def test_the_example_backend_compiles_publishes_and_verifies(tmp_path: Path) -> None:
    path = tmp_path / "site"
    shutil.copytree(EXAMPLE, path)
    out = tmp_path / "art"
    r = qcompiler(tmp_path, "compile", LLAMA, "--scheme", "w4-g32", "--target", "npz", "-o", str(out), path=path)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["graph.qir", "manifest.json", "weights.npz"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == "npz"
    assert manifest["parity"]["ok"]
    with np.load(out / "weights.npz", allow_pickle=False) as z:
        codes = [n for n in z.files if n.endswith(".codes")]
        assert codes
        assert all(z[n].dtype == np.int8 for n in codes)  # the logical codes, one per byte
        assert all(int(z[n].min()) >= -8 and int(z[n].max()) <= 7 for n in codes)
    r = qcompiler(tmp_path, "verify", str(out), "--json", path=path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"]


def test_without_its_line_the_target_is_unknown(tmp_path: Path) -> None:
    r = qcompiler(tmp_path, "compile", LLAMA, "--scheme", "w4-g32", "--target", "npz", "-o", str(tmp_path / "a"))
    assert r.returncode != 0
    assert "unknown target 'npz'" in r.stderr + r.stdout
    assert not (tmp_path / "a").exists()


def test_the_example_backends_declared_kernel_runs_its_layout(tmp_path: Path) -> None:
    path = tmp_path / "site"
    shutil.copytree(EXAMPLE, path)
    out = tmp_path / "art"
    r = qcompiler(tmp_path, "compile", LLAMA, "--scheme", "w8-g32", "--target", "npz", "-o", str(out), path=path)
    assert r.returncode == 0, r.stderr
    r = qcompiler(tmp_path, "verify", str(out), "--level", "4", "--json", path=path)  # fallback forbidden
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"]
    r = qcompiler(
        tmp_path, "run", str(out), "--tokens", "1,2,3", "--max-new-tokens", "2", "--json", "--trace", path=path
    )
    assert r.returncode == 0, r.stderr
    ran = json.loads(r.stdout)
    assert ran["kernels"] == {"prefill": ["npz.codes-linear"], "decode": ["npz.codes-linear"]}
    assert ran["fallback_fraction"] == 0.0
    first = ran["trace"][0]
    assert first["signature"]["layout"] == "npz-codes/v1"
    verdicts = {c["kernel"]: c["reason"] for c in first["candidates"]}
    assert verdicts["cpu.int8pack"] == "groups of 32 not in [0]"  # no core packed kernel takes w8-g32
    assert verdicts["npz.codes-linear"] == "accepted"

"""The command line as a user meets it: installed console script, demo, opt, errors without
tracebacks, and the package layout (passes/ and backends/ installed under qcompiler.*)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from qcompiler.examples import tiny_llama
from qcompiler.ir import parse_module, print_module
from qcompiler.testing import Cli

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("qcompiler")
    assert exe is not None, "the qcompiler console script is installed"
    return subprocess.run([exe, *args], input=stdin, capture_output=True, text=True, cwd=cwd, timeout=120)


def test_demo_compiles_verifies_and_loads_the_artifact(tmp_path: Path) -> None:
    out = tmp_path / "demo-artifact"
    r = run("demo", "--print-ir", "--out", str(out))
    assert r.returncode == 0, r.stderr
    m = parse_module(r.stdout)
    assert m.invariants == ["semantics-frozen", "axes-canonical", "shards-placed", "layouts-packed", "qdq-fused"]
    assert sum(op.name == "q.linear" for op in m.ops()) == 14
    assert "demo passed" in r.stderr
    assert "14/14 bit-exact" in r.stderr
    assert run("verify", str(out)).returncode == 0


def test_opt_pipes_into_opt_idempotently(tmp_path: Path) -> None:
    src = tmp_path / "m.qir"
    src.write_text(print_module(tiny_llama()))
    once = run("opt", str(src))
    twice = run("opt", "-", stdin=once.stdout)
    assert once.returncode == twice.returncode == 0
    assert twice.stdout == once.stdout == src.read_text()


def test_errors_are_one_message_without_traceback(tmp_path: Path) -> None:
    src = tmp_path / "bad.qir"
    src.write_text("module @m {\n  graph @g(%x: tensor<f32[4]>) {\n    %y = relu(%z) : tensor<f32[4]>\n  }\n}\n")
    r = run("opt", str(src))
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert r.stderr.splitlines()[0] == f"{src}:3:15: error: use of undefined value %z"


def test_missing_file_is_a_usage_error(cli: Cli) -> None:
    r = cli("opt", "/nonexistent/x.qir")
    assert r.code == 1
    assert "cannot read /nonexistent/x.qir" in r.err


def test_bad_pipeline_exits_nonzero_without_output(tmp_path: Path, cli: Cli) -> None:
    src = tmp_path / "m.qir"
    src.write_text(print_module(tiny_llama()))
    r = cli("opt", str(src), "--pipeline", "fuse-qdq")
    assert r.code == 1
    assert r.out == ""
    assert "requires 'semantics-frozen', 'axes-canonical'" in r.err


def test_list_passes(cli: Cli) -> None:
    r = cli("opt", "--list-passes")
    assert r.code == 0
    for name in ("freeze-semantics", "canonicalize-axes", "place-shards", "pack-layouts", "fuse-qdq", "emit-container"):
        assert name in r.out
    data = json.loads(cli("opt", "--list-passes", "--json").out)
    by_name = {row["name"]: row for row in data}
    assert by_name["pack-layouts"]["requires"] == ["shards-placed"]
    assert by_name["place-shards"]["options"] == {"tp": 1, "max-shard-size": "5GB", "target": ""}
    assert by_name["dce"]["implemented"] is True


def test_verify_diagnostics_fails_when_a_case_verifies(tmp_path: Path, cli: Cli) -> None:
    src = tmp_path / "cases.qir"
    good = print_module(tiny_llama())
    src.write_text(good + "// -----\nmodule @m {\n}\n")
    r = cli("opt", "--split-input-file", "--verify-diagnostics", str(src))
    assert r.code == 1
    assert "expected a diagnostic, but this input verified" in r.err
    assert "error: module @m: a module needs at least one graph" in r.out


def test_passes_and_backends_install_under_qcompiler(tmp_path: Path) -> None:
    code = (
        "import importlib.util, qcompiler.passes, qcompiler.backends;"
        "print(qcompiler.passes.__file__); print(qcompiler.backends.__file__);"
        "print(importlib.util.find_spec('passes'), importlib.util.find_spec('backends'))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    passes_file, backends_file, top_level = r.stdout.splitlines()
    assert Path(passes_file).resolve() == ROOT / "passes" / "__init__.py"
    assert Path(backends_file).resolve() == ROOT / "backends" / "__init__.py"
    assert top_level == "None None"


def test_opt_output_keeps_its_bytes_beside_it(tmp_path: Path) -> None:
    """-o writes the tensors the output refers to into blobs/ beside it, so another process (and
    another directory) re-reads the IR with its bytes, hashes checked."""
    src = tmp_path / "in" / "m.qir"
    src.parent.mkdir()
    from qcompiler.ir.relocate import relocate_to_files

    src.write_text(print_module(relocate_to_files(tiny_llama(), src.parent)))
    out = tmp_path / "out" / "m.qir"
    out.parent.mkdir()
    r = run("opt", str(src), "-p", "dce,cse", "-o", str(out))
    assert r.returncode == 0, r.stderr
    again = run("opt", str(out), "--verify-data")
    assert again.returncode == 0, again.stderr
    assert all('"file:blobs/' in line for line in out.read_text().splitlines() if line.strip().startswith("tensor "))

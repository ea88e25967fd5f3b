"""``bench/gpu_kernels.py`` is ready to run as is: ``--interpret`` takes every code path but the CUDA
timers (kernel table, correctness gate, compile -> load -> dispatch -> decode) on the CPU, and
without a GPU the plain command says what it needs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_kernels.py"


def test_interpret_mode_runs_the_whole_script(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--interpret", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["kernels"]
    assert {row["phase"] for row in rows} == {"decode", "prefill"}
    assert all(row["rel_err"] < 1e-2 for row in rows)
    e2e = result["e2e"]
    assert e2e["activations"] == ["f16"]
    assert e2e["dispatch"]
    assert all(d["kernel"].startswith("triton.") for d in e2e["dispatch"])
    assert e2e["ours_tok_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the plain command would run")
def test_without_cuda_the_plain_command_says_what_it_needs() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2
    assert "needs a CUDA device" in r.stdout + r.stderr
    assert "--interpret" in r.stdout + r.stderr

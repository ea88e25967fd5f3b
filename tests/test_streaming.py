"""Streaming compiles of HF directories (``qcompiler/frontend/stream.py``): the output bytes do not
depend on ``--jobs`` and equal what the compiler wrote before it streamed (golden hashes); a bf16
source stays bf16 (dense tensors and scales) and transformers loads the result with no missing or
unexpected keys; a bad shard is a typed error naming the file and tensor before any heavy work;
SIGINT/SIGTERM leave nothing behind; peak memory does not grow with depth (a ratio, not a time)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from qcompiler.errors import QcError
from qcompiler.examples import tiny_llama_hf
from qcompiler.frontend.hf_dir import check_source
from qcompiler.testing import CliResult, run_cli

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((ROOT / "golden" / "streaming" / "hashes.json").read_text())
CASES = {"safetensors": ("w4-g32", "safetensors"), "gguf": ("q4_0", "gguf"), "onnx-nbits": ("w4-g32", "onnx-nbits")}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("golden") / "src"  # the name the golden script uses (ONNX metadata holds it)
    tiny_llama_hf().save_pretrained(path)  # pyright: ignore[reportCallIssue]
    return path


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("src") / "sharded"
    tiny_llama_hf().save_pretrained(path, max_shard_size="60KB")  # pyright: ignore[reportCallIssue]
    assert len(list(path.glob("model-*.safetensors"))) >= 3
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


@pytest.mark.parametrize("case", sorted(CASES))
def test_output_bytes_are_the_golden_ones_for_any_jobs(case: str, llama_dir: Path, tmp_path: Path) -> None:
    """The same bytes as the compiler that loaded the whole model (``golden/make_streaming_golden.py``),
    with one worker and with two."""
    scheme, target = CASES[case]
    for jobs in ("1", "2") if case == "safetensors" else ("2",):
        out = tmp_path / f"out-{jobs}"
        r = run_cli("compile", str(llama_dir), "--scheme", scheme, "--target", target, "-o", str(out), "-j", jobs)
        assert r.code == 0, r.err
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["provenance"]["ir"]["frontend"] == "streamed"
        assert {f: sha256(out / f) for f in GOLDEN[case]} == GOLDEN[case], f"--jobs {jobs}"


def test_a_bf16_source_stays_bf16_and_transformers_loads_it(tmp_path: Path) -> None:
    import transformers

    src, out = tmp_path / "bf16", tmp_path / "out"
    tiny_llama_hf().to(torch.bfloat16).save_pretrained(src)  # pyright: ignore[reportCallIssue]
    r = run_cli("compile", str(src), "--scheme", "w4-g32", "--target", "safetensors", "-o", str(out))
    assert r.code == 0, r.err
    entries = {k: v for k, v in header(out / "model.safetensors").items() if k != "__metadata__"}
    floats = {k: v["dtype"] for k, v in entries.items() if v["dtype"] not in ("I32", "I64")}
    assert floats
    assert set(floats.values()) == {"BF16"}, floats
    scales = [k for k in entries if k.endswith(".weight_scale")]
    assert len(scales) == 14
    for name in scales:  # what llmcompressor writes for W4A16 (group 32 here): packed I32, scales BF16, shape I64
        module = name.removesuffix(".weight_scale")
        assert entries[f"{module}.weight_shape"]["shape"] == [2]
        rows, words = entries[f"{module}.weight_packed"]["shape"]
        assert entries[name]["shape"] == [rows, words * 8 // 32]
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest.get("conversions")
    assert json.loads((out / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
        out, local_files_only=True, output_loading_info=True
    )
    model, info = loaded
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 5, 9, 3]])).logits
    assert logits.dtype == torch.bfloat16
    assert bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("target", ["safetensors", "gguf", "onnx-nbits", "triton"])
def test_a_tied_embedding_directory_streams(target: str, tmp_path: Path) -> None:
    """A model whose head is tied to its embedding (Llama 3.2 1B/3B, Qwen2.5 small, Gemma) is saved
    without ``lm_head.weight``; the export may name the tied parameter by its head name, which must
    resolve to the tensor the checkpoint holds. Float into safetensors reproduces the model exactly;
    w4-g32 into every target compiles and verifies."""
    import transformers

    src = tmp_path / "tied"
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(src)
    assert "lm_head.weight" not in header(src / "model.safetensors")
    if target == "safetensors":
        out = tmp_path / "float"
        r = run_cli("compile", str(src), "--target", "safetensors", "-o", str(out), "--quiet")
        assert r.code == 0, r.err
        loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        back, info = loaded
        assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
        ids = torch.tensor([[1, 5, 9, 3, 7]])
        with torch.no_grad():
            assert torch.equal(back.eval()(input_ids=ids).logits, model(input_ids=ids).logits)
    out = tmp_path / "w4"
    r = run_cli("compile", str(src), "--scheme", "w4-g32", "--target", target, "-o", str(out), "--quiet")
    assert r.code == 0, r.err
    assert json.loads((out / "manifest.json").read_text())["provenance"]["ir"]["frontend"] == "streamed"
    assert run_cli("verify", str(out)).code == 0


def refused(r: CliResult, out: Path, *parts: str) -> None:
    assert r.code == 1, (r.code, r.err)
    assert "Traceback" not in r.err, r.err
    assert "internal error" not in r.err, r.err
    for part in parts:
        assert part in r.err, (part, r.err)
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir()] == ["src"], "no temp or spill directory left"


def copy_source(sharded: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(sharded, tmp_path / "src"))


def shards(src: Path) -> list[Path]:
    return sorted(src.glob("model-*.safetensors"))


def index(src: Path) -> dict[str, Any]:
    return json.loads((src / "model.safetensors.index.json").read_text())


def bad_input(src: Path, tmp_path: Path, *parts: str) -> None:
    """The directory gate (before the model is built or any tensor read) refuses it, and so does the CLI."""
    with pytest.raises(QcError) as e:
        check_source(src)
    for part in parts:
        assert part in str(e.value), (part, str(e.value))
    out = tmp_path / "out"
    refused(run_cli("compile", str(src), "--scheme", "w4-g32", "--target", "safetensors", "-o", str(out)), out, *parts)


def test_a_missing_shard_is_named(sharded_dir: Path, tmp_path: Path) -> None:
    src = copy_source(sharded_dir, tmp_path)
    gone = shards(src)[1]
    gone.unlink()
    bad_input(src, tmp_path, gone.name)


def test_a_truncated_shard_is_named(sharded_dir: Path, tmp_path: Path) -> None:
    src = copy_source(sharded_dir, tmp_path)
    victim = shards(src)[1]
    raw = victim.read_bytes()
    victim.write_bytes(raw[:-100])
    bad_input(src, tmp_path, victim.name)


def test_an_index_naming_a_tensor_its_shard_lacks_is_named(sharded_dir: Path, tmp_path: Path) -> None:
    src = copy_source(sharded_dir, tmp_path)
    idx = index(src)
    files = [p.name for p in shards(src)]
    name = next(n for n, f in idx["weight_map"].items() if f == files[0])
    idx["weight_map"][name] = files[1]
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    bad_input(src, tmp_path, name, files[1])


def test_a_shard_header_that_lies_about_a_length_is_named(sharded_dir: Path, tmp_path: Path) -> None:
    src = copy_source(sharded_dir, tmp_path)
    victim = shards(src)[0]
    raw = victim.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + n])
    name = next(k for k in head if k != "__metadata__")
    begin, end = head[name]["data_offsets"]
    head[name]["data_offsets"] = [begin, end - 4]  # the shape says more bytes than the entry holds
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (n - len(text)) if len(text) <= n else b""
    assert len(text) == n
    victim.write_bytes(raw[:8] + text + raw[8 + n :])
    bad_input(src, tmp_path, victim.name, name)


def start_compile(llama_dir: Path, tmp_path: Path, **popen: Any) -> subprocess.Popen[Any]:
    """``qcompiler compile`` of ``llama_dir`` to ``tmp_path/out`` (w4-g32 safetensors, quiet), started
    in a subprocess; its standard error is piped."""
    cmd = [sys.executable, "-m", "qcompiler.cli.main", "compile", str(llama_dir), "--scheme", "w4-g32"]
    cmd += ["--target", "safetensors", "-o", str(tmp_path / "out"), "--quiet"]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, cwd=llama_dir.parent, **popen)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_compile_leaves_nothing(signum: int, llama_dir: Path, tmp_path: Path) -> None:
    """Interrupted while it captures (its spill directory exists): no artifact, no temp directory."""
    proc = start_compile(llama_dir, tmp_path, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".out.spill-") for p in tmp_path.iterdir()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, err
    assert "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [], err


def group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (from ``/proc``; zombies left out)."""
    out: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to list a process group")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_the_export_child_ends_with_the_compile(signum: int, llama_dir: Path, tmp_path: Path) -> None:
    """Signalled while its export child runs (``frontend/forked.py``): the compile reaps the child on
    SIGINT, and the child dies with it on SIGKILL; nothing of the compile's process group is left."""
    # its own group: the signal reaches the compile alone, not the child
    proc = start_compile(llama_dir, tmp_path, stdout=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(group_members(proc.pid)) < 2:
        if proc.poll() is not None:
            pytest.fail("the compile ended before its export child was seen")
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signum)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    deadline = time.monotonic() + 30
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_members(proc.pid) == []


def peak_rss_mb(argv: list[str], cwd: Path) -> float:
    """Run ``argv``; its peak resident set (VmHWM, as ``wait4`` reports it) in MB."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, err.decode()
    return usage.ru_maxrss / 1024


def test_peak_memory_does_not_grow_with_depth(tmp_path: Path) -> None:
    """The same model at 2 and at 8 layers (80 and 213 MB of bf16): peak RSS differs by less than 25%.
    (Holding the model, as the compiler did before it streamed, needed several times its size.)"""
    spec = importlib.util.spec_from_file_location("scale_checkpoint", ROOT / "bench" / "scale_checkpoint.py")
    assert spec is not None
    assert spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    peaks = {}
    for layers in (2, 8):
        src = bench.write_checkpoint(tmp_path / f"src{layers}", "small", layers=layers, shard_mb=60)
        out = tmp_path / f"out{layers}"
        cmd = [sys.executable, "-m", "qcompiler.cli.main", "compile", str(src), "--scheme", "w4-g128"]
        peaks[layers] = peak_rss_mb([*cmd, "--target", "safetensors", "-o", str(out), "--quiet", "-j", "2"], tmp_path)
    assert peaks[8] / peaks[2] < 1.25, peaks


def test_the_shard_takes_over_its_spilled_blobs(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the files are written, the blob store's spill holds none of the tensors they hold (their
    pages go to the rest of the write: ``blob_spill.moved``), and the graph probe run beside the
    write, reading them from the shard, is the one recorded (it is not run again on the reopen)."""
    from qcompiler.artifact import evidence, publish
    from qcompiler.ir import blob_spill

    seen: dict[str, Any] = {}
    real_finish, real_probe = publish.finish, evidence.ProbeAhead.__call__

    def finish(w: Any, m: Any, req: Any, f: Any) -> None:
        seen["shard"] = set()
        for path in w.tmp.glob("*.safetensors"):  # the checkpoint, and the graph's own constants
            raw, head = path.read_bytes(), header(path)
            start = 8 + struct.unpack("<Q", raw[:8])[0]
            seen["shard"] |= {
                hashlib.sha256(raw[start + e["data_offsets"][0] : start + e["data_offsets"][1]]).hexdigest()
                for n, e in head.items()
                if n != "__metadata__"
            }
        seen["spill"] = {p.name for d in blob_spill.SPILLS for p in d.iterdir()}
        seen["moved"] = set(blob_spill.MOVED)
        seen["tensors"] = {t.blob.sha256 for t in m.tensors.values() if t.blob.location == "mem"}
        real_finish(w, m, req, f)

    def probe(self: Any, reopened: Any) -> Any:
        self.thread.join()
        seen["probe_failed"] = self.failed
        return real_probe(self, reopened)

    monkeypatch.setattr(publish, "finish", finish)
    monkeypatch.setattr("qcompiler.backends.safetensors.emit.finish", finish)
    monkeypatch.setattr(evidence.ProbeAhead, "__call__", probe)
    out = tmp_path / "out"
    r = run_cli("compile", str(llama_dir), "--scheme", "w4-g128", "--target", "safetensors", "-o", str(out))
    assert r.code == 0, r.err
    assert not seen["shard"] & seen["spill"]  # nothing the shard holds is still spilled
    assert seen["moved"] == seen["shard"] & seen["tensors"]
    assert seen["moved"]
    assert seen["probe_failed"] is False
    assert not blob_spill.SPILLS
    assert not blob_spill.MOVED
